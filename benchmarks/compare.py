"""TSP against DeepSpeed's own parallelisms on CPU gloo ranks: peak memory,
bytes communicated and step time per rank, for two small models (``--models``):

* ``dense``: Llama-shaped, with a vocabulary realistic for its width (hidden
  512, vocabulary 128,256), at ``--sizes`` (default D = 2);
* ``mla``, the latent-attention row: DeepSeek-V3's multi-head latent attention
  at the same width (``compare_model.mla_config``) over dense MLPs, vocabulary
  32,000, at D = 2: TSP gathers each token's latent and rotary key, the
  baselines attend its expanded heads (or DeepSpeed's refusal is reported).
  With ``--index-topk N`` the row is DeepSeek-V3.2's (files ``_mla_dsa``): its
  lightning indexer chooses each query's ``N`` keys, TSP gathers the index
  keys with the latent; Ulysses swaps only the attention function, so its
  indexer scores each rank's own tokens alone and chooses otherwise (the
  losses column shows it);
* ``hybrid``, the Gated DeltaNet row: Qwen3.5's text model at the same width
  (``compare_model.hybrid_config``: three linear layers to one gated attention
  layer), vocabulary 32,000, at D = 2. TSP exchanges the linear layers' chunk
  state maps (bytes independent of the length); DeepSpeed's Ulysses swaps only
  the attention function, so there its linear layers run on each rank's own
  tokens alone and compute something else (the losses column shows it);
* ``nemotron``, the Mamba-2 row: Nemotron-H at the same width
  (``compare_model.nemotron_config``: layers of one block, Mamba-2 mixers and
  MLPs alternating, one NoPE attention layer), vocabulary 32,000, at D = 2.
  TSP exchanges the Mamba-2 chunks' state maps (one scalar and ``n x p`` a
  head, bytes independent of the length); Ulysses' Mamba-2 layers run on each
  rank's own tokens alone, as the hybrid row's, and compute another model;
* ``moe``, the mixture-of-experts row: Qwen3-MoE-shaped, the same width and
  depth, every layer sparse (``--experts`` experts of ``--expert-intermediate``,
  top-``--top-k``, renormalised), vocabulary 32,000, at ``--moe-sizes``
  (default D = 2 and 4). TSP shards the experts ``E/D`` per rank and moves
  them round the ring or the tokens to them by all-to-all (``ds_tsp.blocks.moe.module``);
  AutoEP holds them ``E/D`` per rank too and sends the tokens by all-to-all;
  Ulysses replicates them; ZeRO-3 partitions them and gathers a layer's at a
  time; DeepSpeed's AutoTP splits what the model's tp_plan names (its
  attention, every expert whole on every rank), or its refusal is reported.
  At D = 4 the row also runs TSP 2 x DP 2 under ZeRO-1, its experts over the
  TSP group (``E/2`` a rank) or folded over both replicas
  (``tsp.expert_parallel_size`` 4, ``E/4`` a rank, tokens to them by an
  all-to-all over all 4 ranks): see ``tsp_2x2`` below for what each rank trains.

    python benchmarks/compare.py --models dense      # the committed dense run (benchmarks/results/compare.md)
    python benchmarks/compare.py --models moe        # the MoE row alone (compare_moe.md, compare_moe_<D>.json)
    python benchmarks/compare.py --models moe --moe-sizes 4 --seq-lens 256 1024 4096 --expert-intermediate 128 \
        --top-k 4 --strategies tsp ulysses_zero3 autoep tsp_2x2 tsp_2x2_ep4 --tag ep   # compare_moe_ep.md
    python benchmarks/compare.py --models mla --seq-lens 512 1024 2048   # the latent-attention row (compare_mla.md)
    python benchmarks/compare.py --models mla --seq-lens 512 1024 2048 --index-topk 256   # compare_mla_dsa.md
    python benchmarks/compare.py --models hybrid --seq-lens 512 1024 2048   # the Gated DeltaNet row (compare_hybrid.md)
    python benchmarks/compare.py --models dense --vocab 32000 --name compare_vocab32000   # a 32K vocabulary
    python benchmarks/compare.py --models dense --lora-rank 16   # LoRA on every projection (compare_lora.md)
    python benchmarks/compare.py --sizes 2 --seq-lens 64 128 --layers 1 --vocab 1024 --out /tmp/cmp  # a smoke run

With ``--lora-rank R`` every strategy trains PEFT's LoRA adapters of rank R
(``--lora-targets``) over the frozen base, the same PeftModel for each: TSP
(``ds_tsp.initialize`` takes the PeftModel), Ulysses and Ulysses + ZeRO-3
(DeepSpeed's engine over the PeftModel) and the single process; the planner
sections are left out (``ds_tsp.planning`` models full fine-tuning).

Strategies, each trained for ``--warmup`` + ``--steps`` AdamW steps on the same
weights and the same sequence (fp32, micro-batch ``--batch``):

* ``single``: one process, no parallelism (DeepSpeed engine, ZeRO-0), the reference;
* ``tsp``: ``ds_tsp.initialize`` with ``tsp.size = D`` (ZeRO-0, DP = 1) and the
  folded vocabulary (``tsp.vocab_parallel`` true, the default): embedding and LM
  head sharded by vocabulary rows, the loss fused with the head on a ring;
* ``tsp_replicated_vocab``: the same with ``tsp.vocab_parallel`` false: the
  embedding and LM head whole on every rank, full logits of the local tokens;
* ``tsp_ring``, ``tsp_all_to_all`` (MoE row only): ``tsp`` with
  ``tsp.moe_schedule`` "ring" (expert shards round the ring) and
  "all_to_all" (tokens to their experts); ``tsp`` itself runs "auto", the
  default, which picks one of the two per layer and micro-batch shape;
* ``autotp``: DeepSpeed AutoTP training, ``"tensor_parallel": {"autotp_size": D}``;
* ``ulysses``: DeepSpeed-Ulysses for HF models (``UlyssesSPAttentionHF``,
  ``sequence_parallel_size = D``), ZeRO-0;
* ``ulysses_zero3``: the same with ZeRO-3 over the same D ranks (ALST style);
* ``autotp_x_ulysses``: AutoTP 2 x Ulysses 2, only where D = 4;
* ``autoep`` (MoE row only): DeepSpeed AutoEP, ``"expert_parallel":
  {"autoep_size": D}`` (``autoep_section``), ZeRO-0, the whole sequence on every rank;
* ``autoep_zero3`` (MoE row only): the same with ZeRO-3 over the same D ranks;
* ``tsp_2x2``, ``tsp_2x2_ep4`` (MoE row, D = 4 only): ``ds_tsp.initialize`` with
  ``tsp.size`` 2 (DP = 2 replicas), ZeRO-1, ``tsp.moe_schedule`` "auto", the
  experts over the TSP group (``E/2`` a rank) or with
  ``tsp.expert_parallel_size`` 4 (``E/4`` a rank; "auto" is then the token
  all-to-all). Each replica trains its own sequence of the same length S, as
  data parallelism is used: replica 0 the sequence every other strategy
  trains, replica 1 another (``DataParallelRun``). A step trains 2 sequences,
  and each rank holds S/2 tokens (TSP 4 and Ulysses S/4, AutoEP and AutoTP S).
  Their losses are replica 0's; after the first update they follow the
  gradients of both sequences, so only the first step's loss at the first
  length (one engine trains the lengths in turn) is set against the single
  process, and ``tsp_2x2_ep4``'s losses against ``tsp_2x2``'s over every step
  (the same data: folding must not change the training).

Each strategy runs in its own process group (``ranks.run_on_ranks``): the
parent imports torch, transformers, DeepSpeed and ds_tsp once and forks D
ranks per strategy, which meet through a file rendezvous and report through a
queue. One engine per strategy trains through the sequence lengths in
ascending order. A rank that
fails is reported as ``unsupported: <error>`` for that strategy and sequence
length (and the longer ones, which are not tried), and the run goes on.

Two settings keep the comparison like for like: ZeRO-3's buckets, and
ZeRO-1's for TSP 2 x DP 2, are sized for this model (``zero3_buckets``), and
Ulysses under ZeRO-0 scales its backward by 1/D (``UlyssesRun``); the
loss-diff column shows every strategy applying the same updates as the single
process.

What is measured (``benchmarks/measure.py``), the same way for every strategy:

* peak live-tensor bytes: a ``TorchDispatchMode`` registers the storage of
  every tensor an op returns, and, on entry, every tensor the garbage
  collector can reach (parameters, their ``.grad``, optimizer state, ZeRO
  buffers); a weak reference per storage subtracts its bytes when it is freed.
  The peak of that sum over one full training step (forward, backward,
  optimizer: the last warm-up step) is what the tables call peak memory; its
  value on entry (a step boundary) is reported as the persistent state. Storages are counted once
  however many views share them. Buffers that collectives allocate inside C++
  are not seen; they are in the RSS figure;
* peak RSS: the kernel's high-water mark (``VmHWM``), reset through
  ``/proc/self/clear_refs`` before the timed steps of each length;
* bytes per rank per step: every ``torch.distributed`` collective and
  point-to-point function is wrapped, before DeepSpeed or ds_tsp are imported,
  in a shim that adds the bytes this rank sends and receives (the ring-algorithm
  convention of ``ds_tsp.parallel.comm``: all-reduce ``2(n-1)/n``, all-gather and
  reduce-scatter ``(n-1)`` per-rank slices, all-to-all ``(n-1)/n``, broadcast and
  reduce ``(n-1)`` at the root and one tensor elsewhere). Object collectives
  are counted through the tensor collectives they are built on. For TSP,
  ds_tsp's own counters are reported too;
* step time: median over the timed steps of forward + backward + optimizer
  step, ranks aligned by a barrier before each step.

Set against the planner (``benchmarks/report.py``): each strategy's peak
against ``ds_tsp.planning.plan``'s per-device total for its counterpart, and both
TSP strategies' counters, op by op and rank by rank, against
``ds_tsp.planning.tsp_step_bytes_by_op`` (given the embedding rows each rank
exchanges for this batch, ``embedding_rows_exchanged``).

Writes ``<name>.md``, ``<name>_<D>.json`` and ``<name>_{memory,time}.png``
under ``--out`` (``--name`` defaults to ``compare``), the MoE row's under
``<name>_moe``, each stem ending in ``_<tag>`` with ``--tag``. ``--vocab`` and
the sizes, where given, apply to both models.
"""

import argparse
import contextlib
import copy
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from measure import LiveTensorBytes, collective_bytes, install_comm_shim, peak_rss_bytes, reset_peak_rss  # noqa: E402

# DeepSpeed and ds_tsp keep references to some of these functions from import
# time on (e.g. ds_tsp.parallel.comm's all-gather), so the shim goes in first.
install_comm_shim()

import deepspeed  # noqa: E402
import torch.distributed.nn.functional as dist_nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from ranks import run_on_ranks  # noqa: E402
from report import write_report  # noqa: E402
from compare_model import model_config  # noqa: E402
from transformers import (DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, LlamaForCausalLM,  # noqa: E402
                          NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3MoeForCausalLM)

import ds_tsp  # noqa: E402
from ds_tsp.parallel import comm as tsp_comm
from ds_tsp.parallel import layout
from ds_tsp.blocks.vocab import shard_rows

LR = 1e-3
IGNORE_INDEX = -100
TSP_LAYOUT = "zigzag"


# --- the strategies ------------------------------------------------------------------------------------------------

def build_model(args):
    """The same weights on every rank of every strategy (seeded): ``args.model``'s
    (``compare_model.model_config``)."""
    torch.manual_seed(0)
    config = model_config(args)
    mla = DeepseekV32ForCausalLM if getattr(args, "index_topk", 0) else DeepseekV3ForCausalLM
    model_class = {"moe": Qwen3MoeForCausalLM, "mla": mla,
                   "hybrid": Qwen3_5ForCausalLM, "nemotron": NemotronHForCausalLM}.get(args.model, LlamaForCausalLM)
    model = model_class(config).float()
    # --lora-rank: PEFT's LoRA model, the base frozen, non-zero B so the adapters change the forward
    # (longest.py's arguments have no LoRA)
    if getattr(args, "lora_rank", 0):
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=args.lora_targets, init_lora_weights=False))
    return model


def ds_config(args, zero_stage=0, **sections):
    # DeepSpeed's default gradient clipping (1.0) is kept for every strategy.
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30, **sections}


def zero3_buckets(args):
    """ZeRO-3 bucket sizes for this model, by the Hugging Face Trainer's "auto"
    rule. DeepSpeed's defaults are sized for billion-parameter models: its
    5e8-element reduce bucket alone is 1.9 GiB of fp32 per rank, which would
    swamp everything this benchmark measures."""
    hidden = args.hidden
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class FullSequenceRun:
    """Every rank gets the whole sequence: single process, TSP (the model takes
    its own tokens), AutoTP (every rank computes every token)."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, input_ids):
        """``input_ids`` its own labels, or a dict of the forward's inputs (a VLM's, ``compare_vlm.py``)."""
        inputs = input_ids if isinstance(input_ids, dict) else {"input_ids": input_ids, "labels": input_ids}
        loss = self.engine(**inputs).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


class DataParallelRun(FullSequenceRun):
    """TSP x DP: each data-parallel replica trains its own sequence of the
    length it is given, replica 0 the one it is given (every other strategy's),
    replica ``r`` the ``r``-th other one (``batch_ids``). The ranks of a replica's
    TSP group feed it whole; the engine keeps each rank's share."""

    def __init__(self, engine, args):
        super().__init__(engine)
        self.args, self.replica = args, engine.tsp_topology.dp_rank

    def step(self, input_ids):
        if self.replica:
            input_ids = batch_ids(self.args, input_ids.shape[-1], self.replica)
        return super().step(input_ids)


class UlyssesRun:
    """Ulysses as ``UlyssesSPDataLoaderAdapter`` feeds it: rank ``r`` of the SP
    group gets the ``r``-th contiguous chunk of ``input_ids``, ``position_ids``
    and the labels shifted on the full sequence (``shift_labels``). Every rank
    here already holds the full micro-batch, so the chunks are cut locally
    instead of all-gathered from DP ranks. The loss is the ALST one: local
    mean losses weighted by their token counts, summed through a
    differentiable all-gather over the SP group.

    That loss sends every rank's backward D times its share (each of the D
    ranks holds the whole loss). DeepSpeed divides the D back out when it
    reduces gradients over the SP ranks with ZeRO-1/2/3, but its ZeRO-0 path
    divides by ``world / sequence_parallel_size`` (= 1 here) only, so with
    ZeRO-0 the gradients are D times too large and, through clipping, the
    training drifts from the single-process run (2e-2 in the loss within 15
    steps). ``backward_scale = 1/D`` under ZeRO-0 restores the same update;
    the loss-diff column checks it."""

    def __init__(self, engine, sp_group, backward_scale=1.0):
        self.engine, self.sp_group, self.backward_scale = engine, sp_group, backward_scale

    def step(self, input_ids):
        sp_size, sp_rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        batch, seq_len = input_ids.shape
        shift_labels = F.pad(input_ids, (0, 1), value=IGNORE_INDEX)[:, 1:]
        positions = torch.arange(seq_len).expand(batch, seq_len)
        chunk = seq_len // sp_size
        own = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        logits = self.engine(input_ids=input_ids[:, own], position_ids=positions[:, own]).logits
        return self.finish(logits, shift_labels[:, own])

    def finish(self, logits, labels):
        """The step from this rank's ``logits`` and shifted ``labels``: the ALST loss, backward, optimizer."""
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        good = (labels != IGNORE_INDEX).sum()
        losses = dist_nn.all_gather(loss, group=self.sp_group)
        goods = dist_nn.all_gather(good, group=self.sp_group)
        loss = sum(l * g for l, g in zip(losses, goods) if g > 0) / max(sum(goods), 1)
        self.engine.backward(loss * self.backward_scale)
        self.engine.step()
        return loss.item()


def register_ulysses(model, sp_size, args):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp_size,
        micro_batch_size=args.batch, seq_length_is_variable=True)


def _deepspeed_engine(model, config, mpu=None):
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config, mpu=mpu)
    return engine


def run_single(world, args):
    return FullSequenceRun(_deepspeed_engine(build_model(args), ds_config(args)))


def _run_tsp(world, args, vocab_parallel=True, moe_schedule="auto"):
    tsp = {"enabled": True, "size": world, "layout": TSP_LAYOUT, "attention_backend": "sdpa",
           "vocab_parallel": vocab_parallel, "moe_schedule": moe_schedule}
    engine, *_ = ds_tsp.initialize(model=build_model(args), optimizer=adamw, config=ds_config(args, tsp=tsp))
    return FullSequenceRun(engine)


def run_tsp(world, args):
    return _run_tsp(world, args)


def run_tsp_replicated_vocab(world, args):
    return _run_tsp(world, args, vocab_parallel=False)


def run_tsp_ring(world, args):
    return _run_tsp(world, args, moe_schedule="ring")


def run_tsp_all_to_all(world, args):
    return _run_tsp(world, args, moe_schedule="all_to_all")


TSP_X_DP_SIZE = 2  # tsp.size of the TSP x DP strategies: D / 2 replicas


def _run_tsp_x_dp(world, args, expert_parallel_size):
    if world != 2 * TSP_X_DP_SIZE:
        raise ValueError(f"tsp_2x2 and tsp_2x2_ep4 run as TSP 2 x DP 2 on 4 ranks, not {world}")
    tsp = {"enabled": True, "size": TSP_X_DP_SIZE, "layout": TSP_LAYOUT, "attention_backend": "sdpa",
           "expert_parallel_size": expert_parallel_size}
    config = ds_config(args, zero_stage=1, tsp=tsp)
    # Buckets sized for this model as ZeRO-3's (zero3_buckets): DeepSpeed's 5e8-element reduce buffer would be the
    # peak of every ZeRO-1 rank here.
    buckets = zero3_buckets(args)["reduce_bucket_size"]
    config["zero_optimization"].update(reduce_bucket_size=buckets, allgather_bucket_size=buckets)
    engine, *_ = ds_tsp.initialize(model=build_model(args), optimizer=adamw, config=config)
    return DataParallelRun(engine, args)


def run_tsp_2x2(world, args):
    return _run_tsp_x_dp(world, args, expert_parallel_size=TSP_X_DP_SIZE)


def run_tsp_2x2_ep4(world, args):
    return _run_tsp_x_dp(world, args, expert_parallel_size=world)


def run_autotp(world, args, build=build_model):
    """``build(args)``: the Hugging Face model (``benchmarks/longest.py``
    passes one with gradient checkpointing on); the same for the runners below."""
    config = ds_config(args, tensor_parallel={"autotp_size": world})
    return FullSequenceRun(_deepspeed_engine(build(args), config))


def run_ulysses(world, args, build=build_model):
    model = build(args)
    mpu = register_ulysses(model, world, args)
    engine = _deepspeed_engine(model, ds_config(args, sequence_parallel_size=world), mpu)
    return UlyssesRun(engine, mpu.get_sequence_parallel_group(), backward_scale=1 / world)


def run_ulysses_zero3(world, args, build=build_model):
    model = build(args)
    mpu = register_ulysses(model, world, args)
    config = ds_config(args, zero_stage=3, sequence_parallel_size=world)
    config["zero_optimization"].update(zero3_buckets(args))
    return UlyssesRun(_deepspeed_engine(model, config, mpu), mpu.get_sequence_parallel_group())


def autoep_section(world):
    """DeepSpeed AutoEP's ``expert_parallel`` section: the experts of every MoE
    block split ``E/D`` per rank over an expert-parallel group of all D ranks
    (one expert-data-parallel replica), tokens sent to their experts by
    all-to-all (``comm_backend`` "comm", i.e. ``torch.distributed``, counted by
    the shim). ``preset_model`` names Hugging Face's Qwen3-MoE layout, so a model
    AutoEP does not know fails instead of being matched against every preset.
    Routing, top-k renormalisation and SwiGLU experts are the preset's, the
    same as the model's (``norm_topk_prob`` true); AutoEP is dropless."""
    return {"enabled": True, "autoep_size": world, "preset_model": "qwen3_moe"}


@contextlib.contextmanager
def _autoep_output_capture_compat():
    """Let DeepSpeed 0.19.8's AutoEP build under transformers >= 5.2x.

    After replacing the MoE blocks, AutoEP retargets transformers' router-logits
    recorder (``output_router_logits``, unused here) by reading and restoring
    ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` as a plain dict
    keyed by ``str(module.__class__)``. transformers now makes it a dict subclass
    whose ``get(model)`` and ``__setitem__(model, ...)`` take the model and key
    it themselves, so AutoEP's ``registry.get(key, default)`` raises
    ``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were
    given``. For the engine's construction only, string keys get plain-dict
    ``get``/``__setitem__``; transformers' own calls (with a model) are unchanged."""
    try:
        from transformers.utils.output_capturing import _CanRecordRegistry
    except ImportError:
        yield
        return
    get, setitem = _CanRecordRegistry.get, _CanRecordRegistry.__setitem__

    def compat_get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else get(self, key)

    def compat_setitem(self, key, value):
        return dict.__setitem__(self, key, value) if isinstance(key, str) else setitem(self, key, value)

    _CanRecordRegistry.get, _CanRecordRegistry.__setitem__ = compat_get, compat_setitem
    try:
        yield
    finally:
        _CanRecordRegistry.get, _CanRecordRegistry.__setitem__ = get, setitem


def _autoep_engine(model, config):
    with _autoep_output_capture_compat():
        return _deepspeed_engine(model, config)


def run_autoep(world, args, build=build_model):
    """AutoEP over D data-parallel ranks that all feed the whole sequence (as for
    AutoTP): an expert sees each of its tokens once from every rank, and
    DeepSpeed divides expert gradients by the data-parallel size D, so every
    gradient is the single process's."""
    config = ds_config(args, expert_parallel=autoep_section(world))
    return FullSequenceRun(_autoep_engine(build(args), config))


def run_autoep_zero3(world, args, build=build_model):
    config = ds_config(args, zero_stage=3, expert_parallel=autoep_section(world))
    config["zero_optimization"].update(zero3_buckets(args))
    return FullSequenceRun(_autoep_engine(build(args), config))


def run_autotp_x_ulysses(world, args):
    tp_size = sp_size = 2
    if world != tp_size * sp_size:
        raise ValueError(f"autotp_x_ulysses runs as AutoTP 2 x Ulysses 2 on 4 ranks, not {world}")
    model = build_model(args)
    mpu = register_ulysses(model, sp_size, args)
    config = ds_config(args, tensor_parallel={"autotp_size": tp_size}, sequence_parallel_size=sp_size)
    engine = _deepspeed_engine(model, config, mpu)
    return UlyssesRun(engine, mpu.get_sequence_parallel_group(), backward_scale=1 / sp_size)


STRATEGIES = {"single": run_single, "tsp": run_tsp, "tsp_replicated_vocab": run_tsp_replicated_vocab,
              "tsp_ring": run_tsp_ring, "tsp_all_to_all": run_tsp_all_to_all, "autotp": run_autotp,
              "ulysses": run_ulysses, "ulysses_zero3": run_ulysses_zero3, "autotp_x_ulysses": run_autotp_x_ulysses,
              "autoep": run_autoep, "autoep_zero3": run_autoep_zero3, "tsp_2x2": run_tsp_2x2,
              "tsp_2x2_ep4": run_tsp_2x2_ep4}


def strategies_for(world, model="dense", lora=False):
    """What runs at ``world`` ranks; the MoE row runs TSP with its default folded
    vocabulary under each ``tsp.moe_schedule`` ("auto", the default, then
    "ring" and "all_to_all"), AutoTP (measured where DeepSpeed runs it, its
    error reported where it refuses), AutoEP with ZeRO-0 and ZeRO-3 and, at 4 ranks, TSP 2 x DP 2 with
    its experts over 2 and 4 ranks (MoE only); with LoRA, TSP, Ulysses and Ulysses + ZeRO-3 (AutoTP does
    not take PEFT layers)."""
    if lora:
        return ["tsp", "ulysses", "ulysses_zero3"]
    if model == "moe":
        names = ["tsp", "tsp_ring", "tsp_all_to_all", "autotp", "ulysses", "ulysses_zero3", "autoep", "autoep_zero3"]
        return names + (["tsp_2x2", "tsp_2x2_ep4"] if world == 2 * TSP_X_DP_SIZE else [])
    if model in ("mla", "hybrid", "nemotron"):
        return ["tsp", "autotp", "ulysses", "ulysses_zero3"]
    names = ["tsp", "tsp_replicated_vocab", "autotp", "ulysses", "ulysses_zero3"]
    if world == 4:
        names.append("autotp_x_ulysses")
    return names


# --- one sequence length, on one rank ------------------------------------------------------------------------------

def batch_ids(args, seq_len, replica=0):
    """The one micro-batch every strategy trains on at ``seq_len``; another
    for each data-parallel ``replica`` > 0 of the TSP x DP strategies."""
    generator = torch.Generator().manual_seed(seq_len)
    # Replica r's batch continues replica 0's stream (a seed past 2**32 would not: torch keeps its low 32 bits).
    return torch.randint(0, args.vocab, (replica + 1, args.batch, seq_len), generator=generator)[replica]


def measure(run, seq_len, args):
    return measure_batch(run, batch_ids(args, seq_len), args)


def measure_batch(run, input_ids, args):
    """One cell's figures of ``run`` training on ``input_ids`` (or a dict of inputs, ``FullSequenceRun.step``)."""
    losses = []
    # First step: builds optimizer state and runs one-off first-forward checks.
    for _ in range(max(args.warmup - 1, 0)):
        losses.append(run.step(input_ids))
    dist.barrier()
    with LiveTensorBytes() as live:
        losses.append(run.step(input_ids))
    dist.barrier()

    collective_bytes.reset()
    tsp_comm.counter.reset()
    rss_reset = reset_peak_rss()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(run.step(input_ids))
        times.append(time.perf_counter() - start)
    ops = {name: count for name, count in collective_bytes.snapshot().items() if name != "barrier"}
    tsp_ops = {name: count for name, count in tsp_comm.counter.snapshot().items() if name != "barrier"}
    per_step = args.steps
    return {
        "peak_live_bytes": live.peak_bytes, "state_bytes": live.state_bytes,
        "peak_rss_bytes": peak_rss_bytes(), "rss_high_water_mark_reset": rss_reset,
        "step_s": statistics.median(times), "step_times_s": times,
        "sent_per_step": sum(c["sent"] for c in ops.values()) // per_step,
        "received_per_step": sum(c["received"] for c in ops.values()) // per_step,
        "by_op_per_step": {name: {k: v // per_step for k, v in c.items()} for name, c in sorted(ops.items())},
        "ds_tsp_received_per_step": sum(c["received"] for c in tsp_ops.values()) // per_step,
        "ds_tsp_by_op_per_step": {name: {k: v // per_step for k, v in c.items()}
                                  for name, c in sorted(tsp_ops.items())},
        "losses": losses,
    }


def run_strategy(strategy, world, args):
    """``{seq_len: [per-rank dict] | "unsupported: <error>"}`` of ``strategy`` on ``world`` forked ranks."""
    return run_on_ranks(STRATEGIES[strategy], measure, args.seq_lens, world, args)


# --- what the planner needs to know of the batch -------------------------------------------------------------------

def embedding_rows_exchanged(args, world, seq_len):
    """Per TSP rank, the tokens whose embedding rows the folded embedding's
    all-to-all brings it for this benchmark's batch: in forward, its own tokens
    whose ids another rank owns; in backward, the other ranks' tokens whose ids
    it owns (their row gradients). The planner's bytes need them exactly."""
    rows = shard_rows(args.vocab, world)
    owners = [layout.shard(batch_ids(args, seq_len), rank, world, TSP_LAYOUT) // rows for rank in range(world)]
    return [(int((owners[rank] != rank).sum()),
             sum(int((owners[other] == rank).sum()) for other in range(world) if other != rank))
            for rank in range(world)]


# --- main ----------------------------------------------------------------------------------------------------------

# The models' own defaults, where --vocab and the sizes are not given.
MODEL_DEFAULTS = {"dense": {"vocab": 128256, "sizes": [2], "suffix": ""},
                  "moe": {"vocab": 32000, "sizes": [2, 4], "suffix": "_moe"},
                  "mla": {"vocab": 32000, "sizes": [2], "suffix": "_mla"},
                  "hybrid": {"vocab": 32000, "sizes": [2], "suffix": "_hybrid"},
                  "nemotron": {"vocab": 32000, "sizes": [2], "suffix": "_nemotron"}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODEL_DEFAULTS), choices=list(MODEL_DEFAULTS),
                        help="the rows to run: dense (Llama), moe (Qwen3-MoE), mla (DeepSeek-V3's attention), hybrid "
                             "(Qwen3.5's Gated DeltaNet layers), nemotron (Nemotron-H's Mamba-2 layers); default all")
    parser.add_argument("--sizes", type=int, nargs="+", help="ranks D per parallel strategy (default: dense 2, "
                                                              "and the MoE row's --moe-sizes)")
    parser.add_argument("--moe-sizes", type=int, nargs="+", help="D for the MoE row (default 2 4; --sizes if given)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES)[1:], choices=list(STRATEGIES)[1:])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps; the last is the memory-tracked one")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1376, help="the dense MLP's")
    parser.add_argument("--experts", type=int, default=8, help="MoE row: experts per sparse layer")
    parser.add_argument("--top-k", type=int, default=2, help="MoE row: experts per token")
    parser.add_argument("--expert-intermediate", type=int, default=512, help="MoE row: one expert's intermediate size")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: dense 128256, Llama 3's; MoE 32000)")
    parser.add_argument("--index-topk", type=int, default=0, help="mla row: DeepSeek-V3.2's, its lightning indexer "
                                                                   "choosing this many keys a query (0: DeepSeek-V3's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0, help="train PEFT LoRA adapters of this rank, the base "
                                                                  "frozen (files named <name>_lora)")
    parser.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])
    parser.add_argument("--strategy-timeout", type=float, default=600, help="seconds for one strategy, all lengths")
    parser.add_argument("--collective-timeout", type=float, default=120, help="gloo timeout, so a dead peer fails")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="compare", help="stem of the files written under --out (the MoE row's "
                                                          "with _moe)")
    parser.add_argument("--tag", help="appended to every row's file stem: --models moe --tag ep writes compare_moe_ep")
    args = parser.parse_args(argv)
    args.seq_lens = sorted(args.seq_lens)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the last warm-up step is the memory-tracked one")
    for model in args.models:
        for world in sizes_of(args, model):
            if world < 2:
                parser.error("--sizes are parallel group sizes, 2 or more (the single process always runs)")
            for seq_len in args.seq_lens:
                if seq_len % (2 * world):
                    parser.error(f"--seq-lens {seq_len} is not a multiple of 2*D = {2 * world}")
            if model == "moe" and args.experts % world:
                parser.error(f"--experts {args.experts} is not divisible by D = {world}: TSP holds E/D experts a rank")
    return args


def sizes_of(args, model):
    if model == "moe" and args.moe_sizes:
        return args.moe_sizes
    return args.sizes or MODEL_DEFAULTS[model]["sizes"]


def model_args(args, model):
    """``args`` for one model's row: its sizes, vocabulary and file stem."""
    defaults = MODEL_DEFAULTS[model]
    row = copy.copy(args)
    row.model, row.sizes = model, sizes_of(args, model)
    row.vocab = args.vocab or defaults["vocab"]
    sparse = "_dsa" if model == "mla" and args.index_topk else ""
    row.name = args.name + defaults["suffix"] + sparse + ("_lora" if args.lora_rank else "") + (
        f"_{args.tag}" if args.tag else "")
    return row


def run_row(args, command):
    """Every strategy at every size for ``args.model``; writes and prints its report."""
    start = time.monotonic()
    results = {"single": run_strategy("single", 1, args)}
    print(f"[{time.monotonic() - start:.0f} s] {args.model}: single process done", flush=True)
    for world in args.sizes:
        for name in strategies_for(world, args.model, bool(args.lora_rank)):
            if name not in args.strategies:
                results[(name, world)] = {s: "unsupported: not run (--strategies)" for s in args.seq_lens}
                continue
            results[(name, world)] = run_strategy(name, world, args)
            status = {s: "ok" if not isinstance(v, str) else v[:100] for s, v in results[(name, world)].items()}
            print(f"[{time.monotonic() - start:.0f} s] {args.model} {name} D={world}: {status}", flush=True)
    meta = {"command": command, "elapsed_s": time.monotonic() - start, "model": _model_card(args),
            "warmup": args.warmup, "timed_steps": args.steps, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "cpu_count": os.cpu_count()}
    rows_exchanged = {(world, s): embedding_rows_exchanged(args, world, s) for world in args.sizes
                      for s in args.seq_lens}
    print(open(write_report(results, args, meta, rows_exchanged)).read())


def main(argv=None):
    args = parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS"))
    command = f"{env} " + " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    for model in args.models:
        run_row(model_args(args, model), command)


def _model_card(args):
    card = {"arch": "LlamaForCausalLM", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "intermediate": args.intermediate, "vocab": args.vocab, "batch": args.batch,
            "dtype": "float32", "optimizer": f"torch.optim.AdamW(lr={LR})"}
    if getattr(args, "lora_rank", 0):
        card.update(lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    if args.model == "mla":
        config = model_config(args)
        card.update(arch="DeepseekV32ForCausalLM" if args.index_topk else "DeepseekV3ForCausalLM",
                    kv_heads=args.heads, **{key: getattr(config, key) for key in (
                        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                        *(("index_n_heads", "index_head_dim", "index_topk") if args.index_topk else ()))})
    if args.model == "hybrid":
        config = model_config(args)
        card.update(arch="Qwen3_5ForCausalLM", head_dim=config.head_dim, **{key: getattr(config, key) for key in (
            "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")})
    if args.model == "nemotron":
        config = model_config(args)
        card.update(arch="NemotronHForCausalLM", head_dim=config.head_dim, **{key: getattr(config, key) for key in (
            "layers_block_type", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")})
        card["layers"] = config.num_hidden_layers
    if args.model == "moe":
        card.update(arch="Qwen3MoeForCausalLM", head_dim=args.hidden // args.heads, experts=args.experts,
                    top_k=args.top_k, expert_intermediate=args.expert_intermediate)
        del card["intermediate"]
    return card


if __name__ == "__main__":
    main()
