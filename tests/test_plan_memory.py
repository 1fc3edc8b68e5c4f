"""The planner's per-device memory (ds_tsp.planning.memory, the plans' peaks)
against hand-computed values and against what the models save for backward
(saved-tensor hooks), dense and MoE, TSP and the Hugging Face baselines."""

from dataclasses import replace

import pytest
import torch

from ds_tsp import planning as planner
from ds_tsp.planning import memory
from plan_helpers import BATCH, SEQ, saved_bytes, tiny_moe_shape, tiny_shape


def test_folded_vocabulary_fits_llama3_8b_at_128k():
    # ds-tsp plan --model llama3-8b --seq-len 128K --devices 8 --activation-checkpointing
    # --zero-stage 1. With the embedding and LM head whole TSP would need 71.6 GB counted naively, most of it
    # the vocabulary's: 12.6 GB of logits, 21.0 GB of loss backward, 16 B x 1.05B embedding + head parameters.
    # The loss backward runs before any gradient exists and before any layer is recomputed, so it overlaps the
    # 3.9 GB of gradients and the recomputed layer's 2.4 GB of saved tensors: 65.4 GB (benchmarks/longest.py
    # measured that overlap).
    plans = {p.name: p for p in planner.plan("llama3-8b", 128 * 1024, 1, 8, "bf16", zero_stage=1,
                                             activation_checkpointing=True)}
    replicated, folded = plans["TSP(8) replicated vocab"], plans["TSP(8)"]
    assert f"{replicated.total / planner.GB:.1f}" == "65.4"
    # The logits the model returns stay through backward; the loss's labels and log-probabilities (and the final
    # norm's and the head's saved tensors) only through the head's phase, counted in its transient.
    assert replicated.memory["logits"] == 16384 * 2 * 128256
    assert replicated.terms[memory.HEAD_PHASE] == replicated.memory["transient"]
    assert folded.total <= 30 * planner.GB
    H, L, Vs, N = 4096, 32, 16032, 16384
    blocks = L * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) // 8
    assert folded.memory["weights"] + folded.memory["grads"] + folded.memory["optimizer"] == \
        16 * (blocks + L * 2 * H + H + 2 * Vs * H)
    assert folded.memory["logits"] == 0 and folded.detail["logits_output"] == 0
    assert folded.detail["logits_tiles"] == 523 * Vs * (4 + 2)  # fp32 logits turned into dz in place, dz in bf16
    assert folded.detail["grad_hidden"] == N * H * 4
    assert folded.detail["head_shards_in_flight"] == 2 * Vs * H * 2
    assert folded.detail["head_grad_accumulators"] == 4 * Vs * H * 4
    assert folded.detail["embedding_backward"] == 2 * N * H * 2 + Vs * H * (4 + 2)
    assert folded.memory["activations"] == replicated.memory["activations"] + N * 8
    # What is left: model states ~16.1 GB (the fp32 master weights and Adam moments, 12 GB, with nothing for
    # ZeRO to partition), 7.2 GB of checkpointed layer inputs and one layer's saved tensors, and a transient
    # that one layer's backward sets rather than the loss: its MLP's (1.24 GB with every tensor the layer
    # saved live, less the embedding's 0.13 GB gradient, which its own backward makes after every layer's),
    # while the head's 1.63 GB runs before any layer is recomputed.
    loss = sum(folded.detail[k] for k in planner.HEAD_BACKWARD)
    mlp_phase = folded.detail["grad_x"] + folded.detail["mlp_shard_intermediates"] + \
        folded.detail["mlp_shards_in_flight"] + folded.detail["mlp_accumulators"]
    assert folded.memory["transient"] == mlp_phase - Vs * H * 2
    assert folded.terms["model states"] == 16 * (blocks + L * 2 * H + H + 2 * Vs * H) - Vs * H * 2
    assert loss > mlp_phase and loss > folded.detail["embedding_backward"]
    # Per step, the head ring (7 hops of the shard forward, 7 of it and of its fp32 accumulator backward)
    # receives what the all-reduce of the whole embedding and head gradients did, 2 x 2 (D-1)/D V H bf16,
    # as V = 8 Vs and 2 + 2 + 4 = 4 x 2 bytes; the embedding all-to-all, 2 x 7/8 N H bf16, is the extra.
    steps = {vocab: planner.tsp_step_bytes_by_op("llama3-8b", 128 * 1024, 1, 8, 2, vocab_parallel=vocab,
                                                 activation_checkpointing=True) for vocab in (True, False)}
    assert steps[True]["all_to_all"] == 2 * 7 * N // 8 * H * 2
    assert steps[True]["ring"] - steps[False]["ring"] == 7 * Vs * H * (2 + 2 + 4) == \
        steps[False]["all_reduce"] - steps[True]["all_reduce"] == 2 * 2 * 7 * 128256 * H * 2 // 8
    assert folded.comm_per_step == sum(steps[True].values())
    assert replicated.comm_per_step == sum(steps[False].values())


def _tsp_model_saved(tsp_size, dtype, arch="llama", vocab_parallel=True, recompute_norms=False):
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_model

    model = inject(tiny_model(arch, dtype=dtype), TSPTopology(tsp_size),
                   TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa", vocab_parallel=vocab_parallel,
                             recompute_norms=recompute_norms))
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    return saved_bytes(model.parameters(), lambda: model(input_ids=input_ids, labels=input_ids))[1]


def _planned(name, devices, dtype, arch="llama", **options):
    from models import tiny_config

    return {p.name: p for p in planner.plan(tiny_config(arch).to_dict(), SEQ, BATCH, devices, dtype,
                                            **options)}[name]


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_saved_activations_equal_the_models(dtype, name):
    from models import tiny_model

    # The whole TSP model (embedding, layers, final norm, LM head, loss), one rank. Mistral's sliding
    # window takes the attention backward that recomputes instead of saving the output and lse. The
    # folded vocabulary saves no embedding ids and no log-probs, only the loss's labels and fp32 lse.
    # tsp.recompute_norms: each RMSNorm keeps only its input (torch's checkpoint saves it).
    for arch, vocab_parallel, recompute_norms in (("llama", True, False), ("llama", False, False),
                                                  ("mistral", True, False), ("llama", True, True)):
        measured = _tsp_model_saved(1, dtype, arch, vocab_parallel, recompute_norms)
        plan_name = planner.tsp_name(1, vocab_parallel)
        planned = _planned(plan_name, 1, name, arch, recompute_norms=recompute_norms).detail["saved_for_backward"]
        print(f"{plan_name} {arch} {name} recompute_norms={recompute_norms}: saved {measured} B, "
              f"planned {planned:.0f} B")
        assert measured == planned
    # The baselines' count is the Hugging Face layer's: the unsharded model.
    hf = tiny_model("llama", dtype=dtype)
    input_ids = torch.randint(0, hf.config.vocab_size, (BATCH, SEQ))
    measured = saved_bytes(hf.parameters(), lambda: hf(input_ids=input_ids, labels=input_ids))[1]
    planned = _planned("DP(1)", 1, name).detail["saved_for_backward"]
    print(f"HF {name}: saved {measured} B, planned {planned:.0f} B")
    assert measured == planned


def test_memory_breakdown_and_model_states():
    plans = planner.plan("llama-7b", 4096, 2, 8, "bf16")
    m = planner.model_shape("llama-7b")
    assert m.params == 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    for p in plans:
        assert set(p.memory) == set(planner.MEMORY_PARTS)
        assert all(v >= 0 for v in p.memory.values())
        assert p.total == pytest.approx(sum(p.memory.values()))
    by_name = {p.name: p for p in plans}
    assert by_name["DP(8)"].memory["weights"] + by_name["DP(8)"].memory["grads"] + \
        by_name["DP(8)"].memory["optimizer"] == 16 * m.params
    # TSP: 1/8 of every block, norms whole; embedding and LM head whole, or 32000/8 rows of each when folded.
    blocks = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) / 8
    norms = 32 * 2 * 4096 + 4096
    tsp = by_name["TSP(8) replicated vocab"]
    assert tsp.memory["weights"] == 2 * (blocks + norms + 2 * 32000 * 4096)
    assert tsp.memory["optimizer"] == 6 * tsp.memory["weights"]
    folded = by_name["TSP(8)"]
    assert folded.memory["weights"] == 2 * (blocks + norms + 2 * 4000 * 4096)
    assert folded.memory["optimizer"] == 6 * folded.memory["weights"]
    # Same blocks; the folded embedding keeps its route (two int64 a token) instead of the ids, and the
    # folded loss saves labels and fp32 lse, no logits.
    assert folded.memory["activations"] == tsp.memory["activations"] + 2 * 4096 / 8 * 8
    # The returned logits stay through backward; the folded loss returns none, and its labels and fp32 lse
    # live only through the head's phase.
    assert folded.memory["logits"] == 0 and tsp.memory["logits"] == 2 * 4096 / 8 * 2 * 32000
    # Checkpointing: every layer keeps only its input, (B, S/D, H) bf16, plus one layer recomputed, whose
    # output DeepSpeed's checkpoint keeps through the layer's backward.
    ckpt = {p.name: p for p in planner.plan("llama-7b", 4096, 2, 8, "bf16", activation_checkpointing=True)}
    tokens = 2 * 4096 / 8
    replicated_ckpt = ckpt["TSP(8) replicated vocab"]
    assert replicated_ckpt.terms["checkpointed layer inputs"] == 32 * tokens * 2 * 4096
    # The attention's backward binds: the MLP's saved tensors are freed by then; live are the first norm's, the
    # attention's x, its q, k and v projections (the local tokens fit one tile), output and lse, and the layer's
    # recomputed output.
    assert replicated_ckpt.terms["saved tensors of the recomputed layer"] == \
        tokens * ((4 * 4096 + 4 + 2 * 4096) + 2 * 4096 + 2 * 3 * 4096 + 2 * 4096 + 4 * 32 + 2 * 4096)
    assert "K/V of one head group" in replicated_ckpt.terms
    # ZeRO partitions over DP (and the sequence axis of SP), never inside TSP or TP.
    zero = {p.name: p for p in planner.plan("llama-7b", 4096, 2, 8, "bf16", zero_stage=3)}
    assert zero["DP(8)"].memory["optimizer"] == by_name["DP(8)"].memory["optimizer"] / 8
    assert zero["SP-Ulysses(8)"].memory["weights"] == by_name["SP-Ulysses(8)"].memory["weights"] / 8
    assert zero["TSP(8)"].memory["optimizer"] == folded.memory["optimizer"]
    assert zero["TSP(8) replicated vocab"].memory["optimizer"] == tsp.memory["optimizer"]


def test_token_tile_and_offloads_reduce_the_right_terms():
    m, S, N, L, H = planner.model_shape("llama3.1-8b"), 128 * 1024, 8, 32, 4096
    tokens, f = S // N, 14336 // N  # 16384 local tokens, 1792 intermediate columns per shard

    def plans(dtype="bf16", zero_stage=1, **options):
        return {p.name: p for p in planner.plan(m, S, 1, N, dtype, zero_stage, True, **options)}

    base, tiled = plans(), plans(token_tile=8192)
    tsp, tsp_tiled = base["TSP(8)"], tiled["TSP(8)"]
    # Two tiles of 8192: the recomputed layer no longer saves every shard's gate and up (2 x F values a token)
    # nor the attention's q, k and v projections (32 + 2 x 8 heads of 128); the MLP's backward holds one tile's
    # gate and up again with its gradients. Nothing else moves.
    qkv = (32 + 2 * 8) * 128
    assert tsp.memory["activations"] - tsp_tiled.memory["activations"] == tokens * 2 * (2 * 14336 + qkv)
    assert tsp.detail["mlp_shard_intermediates"] == 6 * tokens * f * 2
    assert tsp_tiled.detail["mlp_shard_intermediates"] == 8 * 8192 * f * 2
    for key in ("kv_head_group", "grad_x", "attention_shards_in_flight", "mlp_shards_in_flight", "logits_tiles"):
        assert tsp_tiled.detail[key] == tsp.detail[key]
    # Tiled, backward runs the MLP's gate and up and the attention's q, k and v projections again.
    assert tsp_tiled.flops_per_step - tsp.flops_per_step == pytest.approx(
        L * (2 / 3 * 2 * S * m.mlp_params + 2 * S * H * qkv) / N)
    # A tile that holds every local token is no tiling; the baselines have no token tile.
    for tile in (tokens, 10 * tokens):
        assert plans(token_tile=tile)["TSP(8)"].memory == tsp.memory
    assert tiled["TP(8)"].memory == base["TP(8)"].memory

    # fp32_accumulators false: the input gradient sums in bf16, one fp32 (S/D, H) copy less, and so do the head
    # group's full-sequence dK, dV (one KV head a group here); fp32 models have none.
    narrow = plans(fp32_accumulators=False)["TSP(8)"]
    assert tsp.detail["grad_x"] - narrow.detail["grad_x"] == tokens * H * 4
    assert tsp.detail["kv_head_group"] - narrow.detail["kv_head_group"] == 2 * S * 128 * (4 - 2)
    assert {k: v for k, v in narrow.detail.items() if k not in ("grad_x", "kv_head_group")} == \
        {k: v for k, v in tsp.detail.items() if k not in ("grad_x", "kv_head_group")}
    assert plans("fp32", fp32_accumulators=False)["TSP(8)"].memory == plans("fp32")["TSP(8)"].memory

    # recompute_norms: the attention runs its norm inside, keeping only the layer's input (the checkpointed
    # input, counted as such), the MLP's norm keeps its input, instead of a float32 copy, 1/rms and the
    # normalised value each; the final norm too. The attention's backward binds, with the MLP's tensors freed.
    norms = plans(recompute_norms=True)["TSP(8)"]
    blocks = {recompute: memory.tsp_block_saved_per_token(m, 2, "fused", recompute_norms=recompute)
              for recompute in (True, False)}
    assert blocks[False]["attention"] - blocks[True]["attention"] == 4 * H + 4 + 2 * H
    assert blocks[False]["mlp"] - blocks[True]["mlp"] == 4 * H + 4
    # Untiled, the MLP's backward binds, every saved tensor of the layer live; the first norm's input is the
    # checkpointed input.
    assert tsp.terms["saved tensors of the recomputed layer"] - norms.terms["saved tensors of the recomputed layer"] \
        == tokens * (4 * H + 4 + 2 * H + 4 * H + 4 + 2 * H)
    # The final norm's saved tensors live only through the head's phase: what stays outside the layers is the same.
    assert tsp.terms[memory.KEPT_OUTSIDE] == norms.terms[memory.KEPT_OUTSIDE]
    assert plans(recompute_norms=True)["TP(8)"].memory == base["TP(8)"].memory

    # Checkpoints in host memory: the device keeps one layer's input instead of L; the node holds every rank's.
    # The baselines' (Hugging Face's non-reentrant) checkpoint keeps no recomputed output.
    offloaded = plans(offload_activations=True)
    for name in ("TSP(8)", "TP(8)", "SP-Ulysses(8)"):
        kept = base[name].tokens_per_device * 2 * H
        # ds_tsp's host checkpoint also frees the recomputed layer's output, which DeepSpeed's keeps.
        freed = L if name.startswith("TSP") else L - 1
        assert base[name].memory["activations"] - offloaded[name].memory["activations"] == freed * kept
        assert offloaded[name].host == {"host memory for offloaded checkpoints": 8 * L * kept}
        assert offloaded[name].terms["checkpointed input back from host"] == kept
        assert base[name].host == {} and "checkpointed layer inputs" in base[name].terms
    # With 16 devices a node of 8 holds 8 ranks' checkpoints.
    sixteen = {p.name: p for p in planner.plan(m, S, 1, 16, "bf16", 1, True, offload_activations=True)}
    assert sixteen["TSP(16)"].host_total == 8 * L * S // 16 * 2 * H

    # CPU optimizer offload: fp32 master, Adam moments and fp32 gradients go to the host; the device keeps the
    # weights and one layer's (here: the folded LM head's, the largest) gradients.
    states = plans(offload_optimizer=True)["TSP(8)"]
    params = tsp.memory["weights"] / 2
    assert states.memory["optimizer"] == 0 and states.memory["weights"] == tsp.memory["weights"]
    assert states.memory["grads"] == 16032 * H * 2
    assert states.host == {"host memory for the offloaded optimizer": 8 * params * (12 + 4)}
    assert states.memory["activations"] == tsp.memory["activations"]
    with pytest.raises(ValueError, match="activation_checkpointing"):
        planner.plan(m, S, 1, N, offload_activations=True)
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        planner.plan(m, S, 1, N, offload_optimizer=True)
    with pytest.raises(ValueError, match="token_tile"):
        planner.plan(m, S, 1, N, token_tile=-1)


def test_terms_add_up_to_the_peak():
    cases = [planner.plan("llama3.1-8b", 1 << 20, 1, 8, "bf16", 1, True, token_tile=8192, offload_optimizer=True,
                          offload_activations=True),
             planner.plan(tiny_shape(layers=2), SEQ, BATCH, 2, "fp32"), planner.plan("llama-7b", 4096, 2, 8),
             [planner.plan_alst("llama3.1-8b", 1 << 20, n) for n in (1, 8)]]
    for plans in cases:
        for p in plans:
            assert sum(p.terms.values()) == pytest.approx(p.total, rel=1e-12), p.name
            assert all(v > 0 for v in p.terms.values()), p.name


def _live_saved_bytes(params, run):
    """``saved_bytes``, counting only what autograd still holds when ``run()``
    returns: a saved tensor whose node is freed at once (the dropped values of
    the load-balancing loss's top-k) may share its address with a later one."""
    import weakref

    params = {p.untyped_storage().data_ptr() for p in params}
    saved = []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()  # holds the graph, and so what it saved, while the live storages are summed
    live = sum({ptr: nbytes for ref, ptr, nbytes in saved if ref() is not None}.values())
    del out
    return live


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_moe_saved_activations_equal_the_models(dtype, name):
    # One rank, the whole model: TSP's sparse layers (ds_tsp.blocks.moe.module) and Hugging Face's with its default
    # grouped experts (the baselines' count); Qwen2-MoE with a dense layer among the sparse ones; the
    # load-balancing loss on (the tiny configs) and off.
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_config, tiny_model

    for arch, overrides in [("mixtral", {}), ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
                            ("qwen3_moe", {}), ("qwen3_moe", dict(output_router_logits=False)), ("qwen3", {})]:
        plans = {p.name: p for p in planner.plan(tiny_config(arch, **overrides).to_dict(), SEQ, BATCH, 1, name)}
        tsp = inject(tiny_model(arch, dtype=dtype, **overrides), TSPTopology(1),
                     TSPConfig(enabled=True, size=1, attention_backend="sdpa"))
        torch.manual_seed(1)
        input_ids = torch.randint(0, 61, (BATCH, SEQ))
        measured = _live_saved_bytes(tsp.parameters(), lambda: tsp(input_ids=input_ids, labels=input_ids))
        planned = plans["TSP(1)"].detail["saved_for_backward"]
        hf = tiny_model(arch, dtype=dtype, **overrides, **({} if arch == "qwen3" else
                                                          {"experts_implementation": "grouped_mm"}))
        hf_measured = _live_saved_bytes(hf.parameters(), lambda: hf(input_ids=input_ids, labels=input_ids))
        hf_planned = plans["DP(1)"].detail["saved_for_backward"]
        print(f"{arch} {overrides} {name}: TSP saved {measured} B, planned {planned:.0f} B; HF saved "
              f"{hf_measured} B, planned {hf_planned:.0f} B")
        assert measured == planned and hf_measured == hf_planned


def test_hybrid_saved_activations_equal_the_models():
    # The whole TSP model at one rank, against the saved-tensor hooks: Qwen3.5's tiny hybrid (3 Gated DeltaNet
    # layers, each saving its input and its norm's tensors, then a gated attention with per-head q/k norms and a
    # quarter of each head rotary) and Qwen3-Next's (the same with sparse layers) with tsp.recompute_norms. Their
    # RMSNorms scale by 1 + w in float32: each keeps its normalised value in float32, and the factor once a call.
    for arch, dtype, name, recompute_norms in (("qwen3_5", torch.bfloat16, "bf16", False),
                                               ("qwen3_next", torch.float32, "fp32", True)):
        measured = _tsp_model_saved(1, dtype, arch, recompute_norms=recompute_norms)
        planned = _planned("TSP(1)", 1, name, arch, recompute_norms=recompute_norms).detail["saved_for_backward"]
        print(f"TSP(1) {arch} {name} recompute_norms={recompute_norms}: saved {measured} B, planned {planned:.0f} B")
        assert measured == planned
    # Guard: counted as Llama's norms (normalised values in the model's dtype, no factor), the bf16 count is off.
    from models import tiny_config

    llama_norms = replace(planner.model_shape(tiny_config("qwen3_5").to_dict()), norm_in_float32=False)
    plan = {p.name: p for p in planner.plan(llama_norms, SEQ, BATCH, 1, "bf16")}["TSP(1)"]
    assert plan.detail["saved_for_backward"] != _planned("TSP(1)", 1, "bf16", "qwen3_5").detail["saved_for_backward"]


def _saved_and_planned(arch, dtype, name, **overrides):
    """(saved, planned) bytes of the whole TSP model at one rank, against the saved-tensor hooks."""
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_config, tiny_model

    model = inject(tiny_model(arch, dtype=dtype, **overrides), TSPTopology(1),
                   TSPConfig(enabled=True, size=1, attention_backend="sdpa"))
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    saved = saved_bytes(model.parameters(), lambda: model(input_ids=input_ids, labels=input_ids))[1]
    plans = {p.name: p for p in planner.plan(tiny_config(arch, **overrides).to_dict(), SEQ, BATCH, 1, name)}
    return saved, plans["TSP(1)"].detail["saved_for_backward"]


def test_recurrent_layers_saved_activations_equal_the_models():
    # A recurrent layer (the streamed schedule's Mamba-2, Mamba-1 and short convolution; a KDA layer) saves its
    # input alone. Whole models: Bamba (Mamba-2 beside a rotary attention), Granite-4.0-H (NoPE: no rotary
    # tables), Nemotron-H (layers of one block, ungated MLPs, norms weighting in float32), Jamba (Mamba-1, its
    # experts' weights in the model's dtype), LFM2 and LFM2-MoE (short convolutions); and what one more layer
    # adds for a KDA layer, a Nemotron-H Mamba-2 layer, a Jamba Mamba-1 layer and an LFM2 convolution layer.
    whole = [("bamba", torch.bfloat16, "bf16"), ("granitemoehybrid", torch.bfloat16, "bf16"),
             ("nemotron_h_dense", torch.bfloat16, "bf16"), ("nemotron_h_dense", torch.float32, "fp32"),
             ("jamba", torch.bfloat16, "bf16"), ("lfm2", torch.bfloat16, "bf16"), ("lfm2_moe", torch.float32, "fp32")]
    for arch, dtype, name in whole:
        saved, planned = _saved_and_planned(arch, dtype, name)
        print(f"TSP(1) {arch} {name}: saved {saved} B, planned {planned:.0f} B")
        assert saved == planned
    # Guard: Nemotron-H's norms counted as Llama's (their weight multiply in the model's dtype), bf16 is off.
    from models import tiny_config

    llama_norms = replace(planner.model_shape(tiny_config("nemotron_h_dense").to_dict()), norm_weight_in_float32=False)
    plan = {p.name: p for p in planner.plan(llama_norms, SEQ, BATCH, 1, "bf16")}["TSP(1)"]
    assert plan.detail["saved_for_backward"] != _saved_and_planned("nemotron_h_dense", torch.bfloat16, "bf16")[0]
    recurrent_layers = {  # each model's layers: all recurrent, dense MLPs (Nemotron-H's one MLP layer after)
        "kimi_linear": lambda L: dict(num_hidden_layers=L, layer_types=["linear_attention"] * L,
                                      mlp_layer_types=["dense"] * L),
        "nemotron_h_dense": lambda L: dict(layers_block_type=["linear_attention"] * L + ["mlp"]),
        "jamba": lambda L: dict(num_hidden_layers=L, attn_layer_period=8, attn_layer_offset=7,
                                expert_layer_period=8, expert_layer_offset=7),
        "lfm2": lambda L: dict(num_hidden_layers=L, layer_types=["conv"] * L)}
    for arch, overrides in recurrent_layers.items():
        added = [_saved_and_planned(arch, torch.float32, "fp32", **overrides(layers)) for layers in (1, 2)]
        (saved1, planned1), (saved2, planned2) = added
        print(f"TSP(1) {arch}: one more recurrent layer saves {saved2 - saved1} B, planned {planned2 - planned1:.0f} B")
        assert saved2 - saved1 == planned2 - planned1 > 0


def test_mamba2_hybrid_memory_by_hand():
    # Nemotron-H-8B at 128K tokens on 8 devices, bf16, ZeRO-3: N = 16384 local tokens for TSP and the baselines.
    m = planner.model_shape("nemotron-h-8b")
    H, N, di, bc = 4096, 16384, 8192, 1024
    plans = {p.name: p for p in planner.plan(m, 131072, 1, 8, "bf16", 3)}
    tsp, ulysses, heads = plans["TSP(8)"], plans["SP-Ulysses(8)"], plans["CP-heads(8)"]
    # TSP's model states: 1/8 of every Mamba-2 mixer (in_proj's z, x, B, C, dt rows, the 4-tap convolution with
    # its bias, dt_bias, A_log, D, out_proj) and its gated norm whole; the largest attention shard (4 query heads
    # and their o_proj columns, a key/value head); 1/8 of each ungated MLP; one norm a layer; the folded
    # vocabulary's 16384 rows of the embedding and of the head, and the final norm.
    mamba = (H * (2 * di + 2 * bc + 128) + 5 * (di + 2 * bc) + 3 * 128 + di * H) // 8 + di
    attention = 4 * 2 * 128 * H + 2 * 128 * H
    per_rank = 24 * mamba + 4 * attention + 24 * 2 * H * 21504 // 8 + 52 * H + 2 * 16384 * H + H
    assert tsp.memory["weights"] == 2 * per_rank and tsp.memory["optimizer"] == 12 * per_rank
    # A Mamba-2 layer saves its local input and its norm's (float32 input, 1/rms and, weighted in float32, the
    # float32 normalised value).
    assert memory.tsp_block_saved_per_token(m, 2, "fused", linear=True)["attention"] == 2 * H + 4 * H + 4 + 4 * H
    # Its backward: every rank's 2 chunks' maps (one scalar and 128 x 64 a head) and their state gradients,
    # float32, whatever the length; every head of the local tokens recomputed (ds_tsp's torch path).
    all_mamba = {p.name: p for p in planner.plan(replace(m, linear_layers=28), 131072, 1, 8, "bf16", 3)}["TSP(8)"]
    assert all_mamba.detail["state_maps"] == 4 * (2 * 8 * 128 * (1 + 128 * 64) + 2 * 8 * 128 * 128 * 64)
    assert "kv_head_group" not in all_mamba.detail
    # Ulysses runs each Mamba-2 layer on its own tokens: not the model. Megatron-style context parallelism moves
    # the mixers' heads by all-to-all too (z, x, B and C of 8 groups, dt, and the scan's output back): exact, at
    # the price of those bytes, 3 passes with none checkpointed... 2 here (forward and backward).
    assert "24 Mamba-2 layers" in ulysses.inexact and not heads.inexact and not tsp.inexact
    a2a = 7 / 8 * N * (2 * di + 2 * 8 * 128 + 128 + di) * 2
    assert heads.comm_parts["sp_all_to_all"].nbytes - ulysses.comm_parts["sp_all_to_all"].nbytes == \
        pytest.approx(2 * 24 * a2a)
    assert heads.memory["activations"] == ulysses.memory["activations"]
    # At 1M tokens nothing fits 8 devices of 141 GB without checkpointing (TSP's mixers recompute every head of
    # their local tokens); checkpointed on 32 (the attention's heads), TSP holds less than either all-to-all.
    long = {p.name: p for p in planner.plan(m, 1048576, 1, 32, "bf16", 3, activation_checkpointing=True)}
    assert long["TSP(32)"].total < min(long["CP-heads(32)"].total, long["SP-Ulysses(32)"].total, 141e9)


def test_hybrid_memory_by_hand():
    # Qwen3.5-27B at 128K tokens on 8 devices, bf16, ZeRO-3: N = 16384 local tokens for TSP and for Ulysses.
    m = planner.model_shape("qwen3.5-27b")
    H, N, d = 5120, 16384, 256
    plans = {p.name: p for p in planner.plan(m, 131072, 1, 8, "bf16", 3)}
    tsp, ulysses = plans["TSP(8)"], plans["SP-Ulysses(8)"]
    # TSP's model states: 1/8 of every linear layer (16 key and 48 value heads of 128: in_proj, the 4-tap conv,
    # A_log and dt_bias, out_proj) and its gated norm whole; the largest attention shard (3 query heads with their
    # gates and o_proj columns, and a key/value head on its holder) and the q/k norms; 1/8 of the MLP; two norms a
    # layer; the folded vocabulary, ceil(248320 / 8) rows of the embedding and of the head, and the final norm.
    linear = (H * (2 * 2048 + 2 * 6144 + 2 * 48) + (2 * 2048 + 6144) * 4 + 2 * 48 + 6144 * H) // 8 + 128
    attention = 3 * (2 * d * H + d * H) + 2 * d * H + 2 * d
    per_rank = 48 * linear + 16 * attention + 64 * (3 * H * 17408 // 8 + 2 * H) + 2 * 31040 * H + H
    assert tsp.memory["weights"] == 2 * per_rank and tsp.memory["optimizer"] == 12 * per_rank
    # A linear layer saves its local input and its norm's (float32 input, 1/rms, float32 normalised value).
    assert memory.tsp_block_saved_per_token(m, 2, "fused", linear=True)["attention"] == 4 * H + 4 + 4 * H + 2 * H
    # Its backward: one head group's (6 value heads') state maps T, U and their initial-state gradients, float32,
    # for the 2D = 16 chunks; no K/V. Planned alone (every layer linear), its phase shows.
    all_linear = {p.name: p for p in planner.plan(replace(m, linear_layers=64), 131072, 1, 8, "bf16", 3)}["TSP(8)"]
    assert all_linear.detail["state_maps"] == 4 * 16 * 6 * 128 * (128 + 2 * 128)
    assert "kv_head_group" not in all_linear.detail
    # Ulysses + ZeRO-3 runs each linear layer on its own 16384 tokens with the whole weights, ZeRO-3 partitioning
    # them over the 8 ranks: the plan says it is not the model.
    assert ulysses.memory["weights"] == pytest.approx(2 * m.params / 8)
    every = N * (48 * memory.hf_layer_saved_per_token(m, 2, 1, True, linear=True)
                 + 16 * memory.hf_layer_saved_per_token(m, 2, 1, True)) + 64 * 2 * 4 * H + 16 * 2 * 4 * d
    assert ulysses.terms["saved tensors of every layer"] == pytest.approx(every)
    assert "Gated DeltaNet" in ulysses.inexact and not tsp.inexact and not plans["TP(8)"].inexact
    # Megatron-style context parallelism moves the linear layers' heads by all-to-all too: exact.
    assert not plans["CP-heads(8)"].inexact
    assert {p.name for p in planner.recommend(plans.values(), 2000e9)} == {"TSP(8)", "TSP(8) replicated vocab",
                                                                           "TP(8)", "CP-heads(8)"}
    assert "SP-Ulysses(8) (not exact)" in planner.format_table(list(plans.values()))


def test_folded_experts_shrink_the_experts_states():
    # tsp.expert_parallel_size (DESIGN.md 6k) on 8 devices, TSP groups of D = 2 and 4 replicas: Qwen3-MoE-like,
    # no shared expert (ds_tsp folds none), 2 sparse layers of E = 8 experts of 3 H F_e = 384 elements, X = 6144
    # in all. Experts over D alone: X/2 a rank; folded over ep: X/ep, their gradients reduced and ZeRO's
    # partition over the expert-data-parallel group of 8/ep ranks, the dense weights' over the 4 replicas.
    m = tiny_moe_shape(model_type="qwen3_moe", num_experts=8, shared_expert_intermediate_size=0)
    X, dp = 2 * 8 * 3 * 16 * 8, 4
    for zero in (1, 2):
        for ep in (4, 8):
            plans = {p.name: p for p in planner.plan(m, SEQ, BATCH, 8, "bf16", zero, tsp_size=2,
                                                    expert_parallel_size=ep)}
            over_d, folded = plans["TSP(2) x DP(4)"], plans[f"TSP(2) x DP(4), EP({ep})"]
            edp = 8 // ep
            assert folded.feasible and folded.setting.expert_replicas == edp
            assert folded.memory["weights"] - over_d.memory["weights"] == pytest.approx(2 * (X / ep - X / 2))
            grads = (X / ep / edp - X / 2 / dp) if zero == 2 else (X / ep - X / 2)
            assert folded.memory["grads"] - over_d.memory["grads"] == pytest.approx(2 * grads)
            # Adam's 12 B over the ep-data-parallel group: X / (ep * 8/ep), as many as over D's replicas
            assert folded.memory["optimizer"] - over_d.memory["optimizer"] == pytest.approx(12 * (X / ep / edp
                                                                                                  - X / 2 / dp))
            # The all-to-all keeps its exchanged rows: 2 sparse layers x 16 local tokens (B*S/D) x 2 k H bf16.
            saved = folded.detail["saved_for_backward"] - over_d.detail["saved_for_backward"]
            assert saved == 2 * 16 * (2 * 2 * 16 * 2)
    # Refused as ds_tsp refuses them: without ZeRO, with ZeRO-3; a shared expert folds (a TSP MLP of its own).
    for model, zero, why in ((m, 0, "ZeRO-0"), (m, 3, "ZeRO-3"), (tiny_moe_shape(), 1, None)):
        folded = planner.plan(model, SEQ, BATCH, 8, "bf16", zero, tsp_size=2, expert_parallel_size=4)[-1]
        assert folded.name == "TSP(2) x DP(4), EP(4)" and folded.feasible == (why is None)
        assert why is None or why in folded.notes


@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {}), ("qwen2_moe", dict(num_hidden_layers=3,
                                                                                     mlp_only_layers=[1]))])
def test_moe_all_to_all_saved_activations_equal_the_models(arch, overrides):
    # tsp.moe_schedule "all_to_all" at one rank: the rows its experts received and the outputs returned (k a
    # token, exactly so here), Qwen2-MoE's shared expert's output and ring steps, against the saved-tensor hooks.
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_config, tiny_model

    planned = {schedule: {p.name: p for p in planner.plan(tiny_config(arch, **overrides).to_dict(), SEQ, BATCH, 1,
                                                          "bf16", moe_schedule=schedule)}["TSP(1)"]
               for schedule in ("ring", "all_to_all")}
    tsp = inject(tiny_model(arch, dtype=torch.bfloat16, **overrides), TSPTopology(1),
                 TSPConfig(enabled=True, size=1, attention_backend="sdpa", moe_schedule="all_to_all"))
    torch.manual_seed(1)
    input_ids = torch.randint(0, 61, (BATCH, SEQ))
    measured = _live_saved_bytes(tsp.parameters(), lambda: tsp(input_ids=input_ids, labels=input_ids))
    assert measured == planned["all_to_all"].detail["saved_for_backward"]
    assert measured > planned["ring"].detail["saved_for_backward"]  # the guard: the ring's count would not do
