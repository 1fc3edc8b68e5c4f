"""Published numbers the planner is set beside (DESIGN.md 1 and 9).

The TSP paper's setting (llama-7b shape, S = 128K, B = 1, 8 GPUs, bf16: 38.8 GB
TSP, 70.0 TP, 85.0 / 140.0 TP+SP) needs full activation checkpointing: without
it this model puts TP(8) at about 365 GB per GPU, past an MI300X's 192 GB, so
``--paper`` turns checkpointing on for every strategy. With it the estimates
keep the paper's order, TSP < TP < its TP+SP layouts; the measured peaks are
1.1-1.2x the estimates, TP's 0.98x (``tables.format_table`` prints the
comparison). The paper describes TSP schedules for attention and the MLP only,
so its TSP is compared with ``TSP(8) replicated vocab``.

Snowflake's ALST (Bekman et al. 2025, arXiv 2506.13996) trains Llama-3.1-8B at
500K tokens on one H100-80GB, 3.7M on one node of 8 and 15M on 4 nodes (32);
``longest.max_seq_len`` sets those lengths beside its own for that setting.

DeepSpeed-Ulysses' and Megatron context parallelism's (through NeMo) published
per-GPU throughput, with the runs behind them (``TIME_ANCHORS``), are what
``timing.compare_anchor`` sets its step-time model beside.
"""

from collections.abc import Callable
from dataclasses import dataclass

from ds_tsp.planning.shapes import model_shape

# Peak GB per GPU reported by the paper: llama-7b shape, S = 128K, B = 1, 8 MI300X per replica.
# Its two TP+SP layouts are not named in DESIGN.md; their model states 16P/t leave
# about 31 GB of activations at t=2 x c=4 (85.0) and at t=1 x c=8 (140.0), so they
# are placed there (t=4 x c=2 would leave 58 GB, twice the other two). The paper
# describes TSP schedules for attention and the gated MLP only, so its TSP is
# set beside ds_tsp's TSP with the embedding and LM head whole on every rank.
PAPER_SETTING = dict(model="llama-7b", seq_len=131072, micro_batch=1, devices=8, dtype="bf16")
PAPER_PEAK_GB = {"TSP(8) replicated vocab": 38.8, "TP(8)": 70.0, "TP+SP(2x4)": 85.0, "SP-Ulysses(8)": 140.0}
PAPER_LABELS = {"SP-Ulysses(8)": "TP+SP t=1 x c=8"}
PAPER_DEVICE_GB = 192  # MI300X

# ALST's published longest sequences, tokens, by H100-80GB count (decimal K/M, as published).
ALST_MODEL = "llama3.1-8b"
ALST_DEVICE_GB = 80
ALST_PUBLISHED = {1: 500_000, 8: 3_700_000, 32: 15_000_000}
# FPDT's (DeepSpeed's Fully Pipelined Distributed Transformer, MLSys 2025) published longest sequence for an 8B
# model of Llama-3's shape: 2M tokens on 4 GPUs of 80 GB, B=1, bf16; set beside ALST's figures.
FPDT_PUBLISHED = {4: 2_000_000}
# Host memory per node: neither DESIGN.md nor the figures above give it. Assumed: 2 TB, a DGX H100's system
# memory (8 H100-80GB per node, as ALST's nodes). At the published lengths ALST's offloaded checkpoints take
# about 1 TB per node (32 layers x 3.7M tokens x 4096 x 2 B on one node; 15M over four), so 2 TB does not bind.
ALST_HOST_MEMORY_GB = 2000
ALST_DEVICES_PER_NODE = 8


# --- step-time anchors: published throughput beside ``timing``'s model of the same run -------------------------

@dataclass(frozen=True)
class TimeAnchor:
    """A published training run and its throughput: ``gpus`` devices as ``tp``
    x ``sp`` (``kind``: "ulysses", "allgather" for context parallel, "alst"
    for ALST's Ulysses with its tiling and offloads) x data parallel,
    ``sequences_per_step`` sequences of ``seq_len`` per optimizer step, one a
    micro-batch. ``count_flops(anchor)`` is the source's own FLOPs per step
    (whole run), by which it reports ``published_tflops`` (None where it
    reports tokens/s only); ``published_seconds`` is the step time where the
    source gives it or its tokens/s imply it. ``cluster`` holds
    ``timing.Cluster``'s device, attention kernel and matmul dtype for the run;
    ``pp`` pipeline stages and ``ep`` expert-parallel ranks where it has them."""

    label: str
    source: str
    model: dict
    seq_len: int
    gpus: int
    tp: int
    sp: int
    kind: str
    zero_stage: int
    activation_checkpointing: bool
    sequences_per_step: int
    published_tflops: float | None
    published_seconds: float | None
    cluster: dict
    count_flops: Callable
    assumed: str  # what the source does not say and the comparison assumes
    offload_optimizer: bool = False
    in_fit: bool = True  # False: a run no per-step cost explains, set beside the model but kept out of the fits
    pp: int = 1  # pipeline stages (1F1B, one model chunk a stage)
    ep: int = 1  # expert parallel ranks, carved from the data-parallel replicas (experts split over tp as well)

    @property
    def dp(self):
        return self.gpus // (self.tp * self.sp * self.pp)

    @property
    def micro_batches(self):
        """Micro-batches (of one sequence) each replica runs per published step."""
        return self.sequences_per_step // self.dp

    @property
    def seconds(self):
        """The published step time, or the one the published TFLOPs imply."""
        if self.published_seconds is not None:
            return self.published_seconds
        return self.count_flops(self) / (self.published_tflops * 1e12 * self.gpus)

    @property
    def tflops(self):
        """The published TFLOPs per GPU, or the ones the published step time gives by ``count_flops``."""
        if self.published_tflops is not None:
            return self.published_tflops
        return self.count_flops(self) / (self.seconds * 1e12 * self.gpus)


def megatron_deepspeed_flops(anchor):
    """Megatron-DeepSpeed's ``throughput_calculator`` (microsoft/Megatron-DeepSpeed
    megatron/utils.py, after Narayanan et al. 2021 eq. 3): ``24 f B s L h^2 (1 +
    s/(6h) + V/(16 L h))``, ``f`` 4 with activation checkpointing (3 without):
    attention over the full s x s square, the recomputed forward included."""
    m = model_shape(anchor.model)
    B, s, L, h, V = anchor.sequences_per_step, anchor.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    return 24 * (4 if anchor.activation_checkpointing else 3) * B * s * L * h * h * (
        1 + s / (6 * h) + V / (16 * L * h))


def megatron_flops(anchor):
    """Megatron-LM's ``num_floating_point_operations`` (training.py, 2024-2025), a sparse model's
    feed-forward counted as its ``k`` routed experts and its shared one: ``12 B s L h^2 ((1 + nkv/nq + s/h)
    q/h + 1.5 k F_e/h + 1.5 F_s/h + V/(2 L h))``, ``q`` the query projection's width; attention over the full
    s x s square, no recomputation. For a dense Llama (``q = h``) it is NeMo's ``flops_formulas.llama2``
    (NVIDIA/NeMo nemo/utils/flops_formulas.py): ``B s L h^2 (12 + 12 nkv/nq + 18 F/h + 12 s/h + 6 V/(L h))``."""
    m = model_shape(anchor.model)
    B, s, L, h = anchor.sequences_per_step, anchor.seq_len, m.num_layers, m.hidden_size
    routed = m.experts_per_token * m.expert_size if m.is_moe else m.intermediate_size
    q = m.num_heads * m.head_dim / h
    return 12 * B * s * L * h * h * ((1 + m.num_kv_heads / m.num_heads + s / h) * q + 1.5 * routed / h
                                     + 1.5 * m.shared_expert_size / h + m.vocab_size / (2 * L * h))


# DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509v2, https://arxiv.org/abs/2309.14509): section 1
# claims "sustained throughput of over 175 TFlops/GPU (over 54% of hardware peak)"; the runs behind it are
# plotted (Figures 4-5: 7B on 32 and 30B on 64 A100s, dense attention), not tabulated, so their sequence
# lengths cannot be read. Section 4.4's Tables 2 and 3 give time and TFLOPs per GPU for GPT-7B, dense
# attention, global batch 8, A100s: those rows are the anchors. Their TFLOPs equal megatron_deepspeed_flops
# with checkpointing on and V = 50304 (GPT-2's 50257 padded) over their times, within 0.3%.
ULYSSES_SOURCE = "https://arxiv.org/abs/2309.14509 (section 4.4, Tables 2-3)"
# GPT-7B: h 4096, 32 layers, 32 heads, a 4h MLP of two matrices (8h^2 weights, as the gated 3hF with F = 8h/3),
# embedding tied to the head.
ULYSSES_MODEL = dict(hidden_size=4096, intermediate_size=10923, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, head_dim=128, vocab_size=50304, tie_word_embeddings=True,
                     name="gpt-7b")
# (seq_len, GPUs): (milliseconds per iteration, TFLOPs per GPU), as published.
ULYSSES_PUBLISHED = {(65536, 64): (9676.76, 161.3626667), (131072, 64): (32432.1333, 165.526667),
                     (131072, 128): (17052.5143, 157.41), (131072, 256): (9886.7, 136.09),
                     (262144, 256): (33486.5, 147.4)}
# Kernels: the paper does not name its attention kernel; DeepSpeed's Ulysses tutorial of the time
# (docs/_tutorials/ds-sequence.md) runs Megatron-DeepSpeed with FlashAttention v1.0.4 or its Triton version
# (--use-flash-attn-triton), so FlashAttention 1's A100 rates are taken.
A100_FA1 = dict(device="a100", attention_kernel="fa1")
ULYSSES_ASSUMED = ("data parallel 8 (one sequence per replica per step: global batch 8 at every GPU count), so "
                   "Ulysses over GPUs/8; ZeRO-3 over all GPUs, as the paper's section 4.2 runs it; nodes of 8 A100s "
                   "with one 200 Gb/s NIC per GPU; FlashAttention 1, as DeepSpeed's Ulysses tutorial runs it")

# Megatron-Core context parallelism through NeMo: "Long Sequence Performance", LLAMA2-7B FP8 on DGX-H100,
# container NeMo 24.03.01
# (https://github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_long_sequence.md).
# The table gives TFLOPs per GPU, the layout and the global batch (sequences), not the step time or the FLOPs
# formula.
NEMO_CP_SOURCE = "NVIDIA/NeMo docs/source/performance/performance_long_sequence.md (LLAMA2-7B FP8, DGX-H100)"
# (seq_len, GPUs): (TP, CP, DP, global batch, TFLOPs per GPU with CP); its 8K row runs PP 2, which the
# planner does not model, and is left out.
NEMO_CP_PUBLISHED = {(4096, 4): (1, 1, 4, 1024, 768.0), (16384, 16): (2, 1, 8, 256, 660.0),
                     (32768, 32): (2, 2, 8, 128, 610.0), (65536, 64): (4, 2, 8, 64, 574.0),
                     (131072, 128): (4, 4, 8, 32, 555.0), (262144, 256): (4, 8, 8, 16, 549.0),
                     (524288, 512): (8, 16, 4, 8, 549.0), (1048576, 1024): (8, 32, 4, 4, 536.0)}
# FP8 matmuls, attention in BF16 through Transformer Engine's cuDNN fused attention (Megatron-Core's TE layers).
H100_FP8_CUDNN = dict(device="h100", attention_kernel="cudnn", matmul_dtype="fp8")
NEMO_CP_ASSUMED = ("FLOPs counted by NeMo's llama2 formula (the table does not say); one sequence a micro-batch; "
                   "Megatron's distributed optimizer as ZeRO-1; no activation recomputation; FP8 matmuls, BF16 "
                   "attention through cuDNN; TP innermost, then CP, on nodes of 8")

# ALST (Bekman et al. 2025, arXiv 2506.13996 v1, Tables 2-4): Llama-3.1-8B, one sequence a step over Ulysses on
# every GPU (H100 80GB, 8 a node), ZeRO-3 with the optimizer in host memory, checkpoints offloaded, tiled MLP and
# loss, FlashAttention 2.7.4; TFLOPs by Megatron's formula with the repeated forward. The lengths are the
# recipes' max_length (snowflakedb/ArcticTraining projects/sequence-parallelism/run-h100-sp{1,8,32}-llama-8b.yml:
# 500_000, 3_800_000, 15_500_000), with which megatron_deepspeed_flops over the published times gives the
# published TFLOPs within 0.4%; the paper labels them 500K, 3.7M and 15M.
ALST_SOURCE = "https://arxiv.org/abs/2506.13996 (Tables 2-4)"
# (seq_len, GPUs): (iteration seconds, TFLOPs per GPU)
ALST_TIMED = {(500_000, 1): (16 * 60 + 50, 548.1), (3_800_000, 8): (3600 + 47 * 60 + 35, 590.6),
              (15_500_000, 32): (7 * 3600 + 25 * 60 + 9, 590.6)}
H100_FA2 = dict(device="h100", attention_kernel="fa2")
ALST_ASSUMED = ("the single-GPU run also offloads the weights to the host (not timed); host optimizer steps and "
                "offloads are not timed")

# Hugging Face's Ulysses blog (huggingface.co/blog/ulysses-sp, 2026-03-09; huggingface/blog ulysses-sp.md):
# Qwen3-4B through TRL's SFTTrainer on H100 80GB, ZeRO-3 with the optimizer offloaded to the CPU, gradient
# checkpointing, flash-attn 2, micro-batch 1 and 8 accumulation steps (global batch 8): tokens/s.
HF_BLOG_SOURCE = "https://huggingface.co/blog/ulysses-sp (Qwen3-4B, H100)"
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, name="qwen3-4b")
# (seq_len, GPUs): tokens per second
HF_BLOG_PUBLISHED = {(8192, 1): 3633, (8192, 4): 3933, (32768, 4): 7733, (65536, 4): 13396}
HF_BLOG_ASSUMED = ("tokens/s of the whole run (the blog does not say; DP 1), every sequence full length; the host "
                   "optimizer step and its transfers are not timed. Kept out of the fits: no per-step cost reconciles "
                   "its rows (the time over the kernels' is 15 s a step at 8K, 22 s at 32K and none at 64K)")

# Megatron-Core's MoE layouts (Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960, Tables 1 and 3): MFU of
# the BF16 peak (989.5 TFLOPs) on DGX H100 (NVLink 450 GB/s, 400 Gb/s IB), sequence 4096, global batch 256,
# token dropping at capacity factor 1. The "MCore" rows' layouts split every expert over TP as the attention
# (ETP = TP), as the planner's baselines do; the folding rows (ETP 1) are not modelled.
MOE_SOURCE = "https://arxiv.org/abs/2504.14960 (Tables 1 and 3, MCore rows)"
MIXTRAL_8X22B = dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                     num_attention_heads=48, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                     tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, name="mixtral-8x22b")
# Mixtral-8x22B's experts each cut into 8 (64 experts of F/8, 8 a token): the paper's G8T8
MIXTRAL_G8T8 = dict(MIXTRAL_8X22B, intermediate_size=2048, num_local_experts=64, num_experts_per_tok=8,
                    name="mixtral-8x22b-g8t8")
QWEN2_57B_A14B = dict(model_type="qwen2_moe", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=2560,
                      shared_expert_intermediate_size=20480, decoder_sparse_step=1, mlp_only_layers=[],
                      name="qwen2-57b-a14b")
# label: (model, GPUs, TP, EP, PP, MFU)
MOE_PUBLISHED = {"Mixtral-8x22B": (MIXTRAL_8X22B, 128, 2, 4, 8, 0.463),
                 "Qwen2-57B-A14B": (QWEN2_57B_A14B, 64, 2, 4, 4, 0.353),
                 "Mixtral-8x22B G8T8": (MIXTRAL_G8T8, 128, 2, 8, 8, 0.171)}
H100_BF16_CUDNN = dict(device="h100", attention_kernel="cudnn")
MOE_ASSUMED = ("FLOPs counted by Megatron-LM's formula (the paper does not say); micro-batch 1, 1F1B without "
               "interleaving (the paper gives neither); Megatron's distributed optimizer as ZeRO-1; no recomputation; "
               "cuDNN attention through Transformer Engine; the pipeline's point-to-point activations and the "
               "router's token permutation are not timed; the slowest stage holds L/PP layers and the LM head")


TIME_ANCHORS = tuple(
    [TimeAnchor(f"DeepSpeed-Ulysses GPT-7B {s // 1024}K, {n} A100", ULYSSES_SOURCE, ULYSSES_MODEL, s, n, 1, n // 8,
                "ulysses", 3, True, 8, tflops, ms / 1e3, A100_FA1, megatron_deepspeed_flops, ULYSSES_ASSUMED)
     for (s, n), (ms, tflops) in ULYSSES_PUBLISHED.items()]
    + [TimeAnchor(f"Megatron CP (NeMo) Llama-2-7B {s // 1024}K, {n} H100 FP8", NEMO_CP_SOURCE, "llama-7b", s, n,
                  tp, cp, "allgather", 1, False, batch, tflops, None, H100_FP8_CUDNN, megatron_flops,
                  NEMO_CP_ASSUMED)
       for (s, n), (tp, cp, dp, batch, tflops) in NEMO_CP_PUBLISHED.items()]
    + [TimeAnchor(f"ALST Llama-3.1-8B {s / 1e6:g}M, {n} H100", ALST_SOURCE, ALST_MODEL, s, n, 1, n, "alst", 3, True,
                  1, tflops, seconds, H100_FA2, megatron_deepspeed_flops, ALST_ASSUMED, offload_optimizer=True)
       for (s, n), (seconds, tflops) in ALST_TIMED.items()]
    + [TimeAnchor(f"HF Ulysses blog Qwen3-4B {s // 1024}K, {n} H100", HF_BLOG_SOURCE, QWEN3_4B, s, n, 1, n,
                  "ulysses", 3, True, 8, None, 8 * s / tokens_per_s, H100_FA2, megatron_flops, HF_BLOG_ASSUMED,
                  offload_optimizer=True, in_fit=False)
       for (s, n), tokens_per_s in HF_BLOG_PUBLISHED.items()]
    + [TimeAnchor(f"Megatron-Core MoE {label}, {n} H100", MOE_SOURCE, model, 4096, n, tp, 1, "allgather", 1, False,
                  256, mfu * 989.5, None, H100_BF16_CUDNN, megatron_flops, MOE_ASSUMED, pp=pp, ep=ep)
       for label, (model, n, tp, ep, pp, mfu) in MOE_PUBLISHED.items()])
