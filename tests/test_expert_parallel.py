"""Experts folded over data-parallel replicas (``tsp.expert_parallel_size``,
DESIGN.md 6k) against one process over the same global batch, float64.

TSP 2 x DP 2 with ``expert_parallel_size`` 4: each rank holds ``E/4`` experts
and the token all-to-all runs over all 4 ranks, so a replica's tokens reach
experts the other replica holds. The reference is Hugging Face's model run on
each replica's rows, its losses (the load-balancing loss per replica, as data
parallelism computes it) averaged; the TSP gradients are reduced as DeepSpeed
reduces them (dense ones averaged over the replicas, the experts' summed over
their expert-data-parallel group and divided by the replicas), then compared
with the reference's piece by piece within ``parity.TOLERANCE``.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param

import ds_tsp
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.config import TSPConfig, TSPConfigError
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from parity import TOLERANCE, shard_grad_diffs
from test_moe import build_case, hf_loss

TSP, EP = 2, 4
# (arch, global batch, seq_len, right_padding, routing, model overrides): "first_experts" sends every token of
# both replicas to experts 0 and 1, rank 0's, so the other three ranks' experts get no row.
# Qwen2-MoE's gated shared expert and DeepSeek-V3's ungated one (with its latent attention, sigmoid routing and
# a dense first layer) are TSP MLPs of their own beside the folded routed experts.
CASES = [
    ("qwen3_moe", 4, 12, 0, "random", {}),
    ("qwen2_moe", 4, 12, 0, "random", {}),
    ("deepseek_v3", 4, 13, 3, "random", {}),
    ("qwen3_moe", 4, 13, 3, "first_experts", {}),
    ("mixtral", 4, 12, 0, "random", {"num_local_experts": 8}),
    ("mixtral", 4, 12, 0, "first_experts", {"num_local_experts": 8}),
]


def reduce_like_deepspeed(model, topology):
    """Every gradient as the engine leaves it: experts (DeepSpeed's MoE tags)
    summed over their expert-data-parallel group, the rest over the replicas,
    both divided by the replicas."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=topology.edp_group if is_moe_param(param) else topology.dp_group)
            param.grad /= topology.dp_size


def folded_parity(cases, wrong_owner=False):
    """On every rank, per case: |loss - reference| and the gradient diffs.
    ``wrong_owner``: the last rank holds the experts of expert-parallel rank 0."""
    topology = TSPTopology(TSP, expert_parallel_size=EP)
    results = []
    for case in cases:
        ref, input_ids, attention_mask = build_case(*case)
        rows = input_ids.shape[0] // topology.dp_size
        mine = slice(topology.dp_rank * rows, (topology.dp_rank + 1) * rows)
        model = ds_tsp.inject(copy.deepcopy(ref), topology, TSPConfig(
            enabled=True, size=TSP, expert_parallel_size=EP, attention_backend="sdpa"))
        blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, TSPSparseMoE)]
        if wrong_owner and topology.ep_rank == EP - 1:
            hf_block = ref.model.layers[0].mlp
            with torch.no_grad():
                blocks[0].packed.copy_(blocks[0].spec.pack({
                    name: hf_block.get_parameter(name).narrow(0, 0, blocks[0].num_experts // EP)
                    for name in blocks[0].spec.shapes}))
        masks = (None,) * topology.dp_size if attention_mask is None else attention_mask.split(rows)
        out = model(input_ids=input_ids[mine], labels=input_ids[mine], attention_mask=masks[topology.dp_rank])
        out.loss.backward()
        reduce_like_deepspeed(model, topology)
        replicas = [hf_loss(ref, ids, mask) for ids, mask in zip(input_ids.split(rows), masks)]
        (sum(loss for loss, *_ in replicas) / len(replicas)).backward()
        # The loss with the replica's aux loss summed exactly (test_moe.hf_loss), this replica's.
        results.append({"loss": abs(out.loss.item() - replicas[topology.dp_rank][2]),
                        "grads": shard_grad_diffs(model, ref),
                        "experts": [block.spec.shapes[block.experts.down][0] * EP == block.num_experts
                                    for block in blocks],
                        "folded": all(is_moe_param(block.packed) for block in blocks)})
    return results


def test_folded_experts_match_one_process_over_the_global_batch(run_ranks):
    """Qwen3-MoE and Mixtral (8 experts, 2 a rank) with random routing and with
    every token of both replicas routed to rank 0's experts; Qwen2-MoE and
    DeepSeek-V3 (4 experts, 1 a rank) with their shared experts."""
    per_rank = run_ranks(TSP * 2, folded_parity, cases=CASES)
    for i, case in enumerate(CASES):
        results = [rank[i] for rank in per_rank]
        loss = max(r["loss"] for r in results)
        grads = {name: max(r["grads"][name] for r in results) for name in results[0]["grads"]}
        worst = max(grads, key=grads.get)
        print(f"TSP 2 x DP 2, experts over 4: {case[0]} {case[4]} pad={case[3]}: loss {loss:.2e}, "
              f"gradients {grads[worst]:.2e} ({worst})")
        assert all(r["folded"] and all(r["experts"]) for r in results)  # E/4 experts a rank
        assert "model.layers.1.mlp.experts.gate_up_proj" in grads and "model.layers.1.mlp.gate.weight" in grads
        shared = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}.get(case[0])
        assert shared is None or f"model.layers.1.mlp.{shared}.down_proj.weight" in grads
        assert loss <= TOLERANCE and grads[worst] <= TOLERANCE, (loss, worst, grads[worst])


def test_a_wrong_expert_owner_is_caught(run_ranks):
    per_rank = run_ranks(TSP * 2, folded_parity, cases=CASES[:1], wrong_owner=True)
    loss = max(rank[0]["loss"] for rank in per_rank)
    grads = max(max(rank[0]["grads"].values()) for rank in per_rank)
    print(f"last rank holding rank 0's experts: loss moves {loss:.2e}, gradients {grads:.2e}")
    assert loss > 1e6 * TOLERANCE and grads > 1e6 * TOLERANCE


@pytest.mark.parametrize("options, message", [
    ({"expert_parallel_size": 3}, "choose one of 2, 4"),
    ({"expert_parallel_size": 4, "moe_schedule": "ring"}, "set tsp.moe_schedule to"),
])
def test_sizes_the_mesh_cannot_take_are_refused_naming_the_key(options, message):
    with pytest.raises(TSPConfigError, match="tsp.expert_parallel_size") as error:
        TSPConfig(enabled=True, size=2, **options).expert_parallel(4)
    assert message in str(error.value)


def _refused(arch, overrides, expert_parallel_size):
    topology = TSPTopology(TSP, expert_parallel_size=expert_parallel_size)
    model = tiny_model(arch, **overrides)
    before = {name: p.clone() for name, p in model.named_parameters()}
    try:
        ds_tsp.inject(model, topology, TSPConfig(enabled=True, size=TSP, expert_parallel_size=expert_parallel_size))
    except (TSPConfigError, ValueError) as error:
        untouched = all(torch.equal(p, before[name]) for name, p in model.named_parameters())
        return str(error), untouched and not any(type(m).__name__.startswith("TSP") for m in model.modules())
    return None, False


@pytest.mark.parametrize("arch, overrides, message", [
    ("llama", {}, "has no mixture-of-experts layer"),
    ("qwen3_moe", {"num_experts": 6}, "does not divide the model's 6 experts"),
])
def test_models_folded_experts_cannot_take_are_refused_before_any_weight_moves(run_ranks, arch, overrides, message):
    for error, untouched in run_ranks(4, _refused, arch=arch, overrides=overrides, expert_parallel_size=4):
        assert error is not None and "tsp.expert_parallel_size = 4" in error and message in error, error
        assert untouched


@pytest.mark.parametrize("zero_stage, arch, optimizer", [(1, "qwen3_moe", "adam"), (2, "qwen3_moe", "adam"),
                                                         (2, "mixtral", "sgd"), (1, "qwen2_moe", "sgd"),
                                                         (2, "gemma4_moe", "sgd")])
def test_engine_trains_like_one_process_with_experts_over_four_ranks(run_ranks, zero_stage, arch, optimizer):
    """fp32, TSP 2 x DP 2, experts over all 4 ranks (DeepSpeed's MoE groups):
    weights and gradient norms as one process's; each rank's optimizer steps
    a quarter of the experts, none twice, and half the dense weights (ZeRO
    over the 2 replicas). Adam at lr 3e-3: at test_engine's 1e-2, float32
    Adam on tiny Qwen3-MoE drifts from the one-process run by 6e-6 in weights
    and 3e-5 in the third step's norm with the experts on the TSP group alone
    too (expert_parallel_size 2: 6.4e-6). Mixtral and Qwen2-MoE (its shared
    expert a TSP MLP beside the folded experts) with SGD: their experts under
    Adam drift to 2.4e-5 and 6.6e-6 with gradient norms within 1.3e-7, as
    test_engine's Mixtral rows say of them at DP=2 unfolded."""
    from test_engine import _train_and_compare, assert_within_control

    per_rank = run_ranks(4, _train_and_compare, tsp_size=TSP, zero_stage=zero_stage, optimizer=optimizer, arch=arch,
                         moe_schedule="auto", tsp_options={"expert_parallel_size": EP},
                         lr=3e-3 if optimizer == "adam" else None)
    ref = tiny_model(arch)
    experts = sum(p.numel() for name, p in ref.named_parameters() if ".experts." in name)
    states = [out["optimizer_states"] for out in per_rank]
    for rank, out in enumerate(per_rank):
        assert_within_control(out, f"rank {rank} {arch} {optimizer} ZeRO-{zero_stage} TSP 2 x DP 2, experts over 4 "
                                   f"(optimizer holds {states[rank]} of {experts} expert elements)")
        assert any("experts.gate_up_proj" in name for name in out["rel"])
        assert out["generated"] == ("refused", None)
    assert [state["experts"] for state in states] == [experts // EP] * 4  # a quarter each, so none twice
    assert len({state["dense"] for state in states}) <= 2


@pytest.mark.parametrize("section, tsp, message", [
    ({"zero_optimization": {"stage": 3}}, {}, "zero_optimization.stage = 3"),
    ({}, {}, "zero_optimization.stage = 0"),
    ({"zero_optimization": {"stage": 2}}, {"pipeline_stages": 2}, "tsp.pipeline_stages = 2"),
])
def test_what_deepspeed_cannot_run_with_folded_experts_is_refused(section, tsp, message):
    from ds_tsp.runtime.expert_parallel import check_expert_parallel_run

    with pytest.raises(TSPConfigError, match="tsp.expert_parallel_size = 4") as error:
        check_expert_parallel_run(section, TSPConfig(enabled=True, size=2, expert_parallel_size=4, **tsp))
    assert message in str(error.value)
    check_expert_parallel_run(section, TSPConfig(enabled=True, size=2, **tsp))  # experts on the TSP group: taken


def _save_and_load(out_dir):
    """save_pretrained of a folded model, then from_pretrained at the same
    layout: ``(whether every rank's shard came back bit for bit, the saved
    directory)``."""
    topology = TSPTopology(TSP, expert_parallel_size=EP)
    config = TSPConfig(enabled=True, size=TSP, expert_parallel_size=EP)
    model = ds_tsp.inject(tiny_model("qwen3_moe"), topology, config)
    ds_tsp.save_pretrained(model, out_dir)
    loaded = ds_tsp.from_pretrained(out_dir, topology, config)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_save_pretrained_writes_hugging_faces_model_and_from_pretrained_reads_each_ranks_experts(run_ranks, tmp_path):
    """Every replica's experts gathered over the expert-parallel group into
    Hugging Face's files, bit for bit; read back at the folded layout, each
    rank takes its own quarter."""
    from transformers import AutoModelForCausalLM

    assert all(run_ranks(4, _save_and_load, out_dir=str(tmp_path / "hf")))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).state_dict()
    ref = tiny_model("qwen3_moe").state_dict()
    assert saved.keys() == ref.keys() and all(torch.equal(saved[name], ref[name]) for name in ref)


def _folded_block_bytes(balanced):
    """Layer 0's folded MoE block (Qwen3-MoE, float32) on this rank's tokens:
    the bytes counted forward and forward + backward, and the rows this rank
    receives per pass, counted from every rank's routing over the expert-parallel group."""
    from ds_tsp.parallel import comm
    from test_moe import _balanced_routing, _count

    topology = TSPTopology(TSP, expert_parallel_size=EP)
    ref = tiny_model("qwen3_moe", dtype=torch.float32)
    block = TSPSparseMoE.from_hf(ref.model.layers[0].mlp, topology.tsp_group, ep_group=topology.ep_group)
    torch.manual_seed(11 + topology.rank)
    x = torch.randn(2, 8, ref.config.hidden_size)
    top_k = ref.config.num_experts_per_tok
    if balanced:
        x = _balanced_routing(block, x, top_k)
    _, _, index = block.gate(x.reshape(-1, x.shape[-1]))
    sends = torch.bincount(index.reshape(-1) // (block.num_experts // EP), minlength=EP)  # rows to each owner
    every = comm.all_gather_small(sends, topology.ep_group)  # (EP, EP): every rank's sends
    rank = topology.ep_rank
    rows = int(every[:, rank].sum() - every[rank, rank] + sends.sum() - sends[rank])
    forward, total = _count(block, x)
    return {"forward": forward, "total": total, "rows": rows, "tokens": x.shape[0] * x.shape[1],
            "sizes": (block.hidden_size, block.num_experts, block.expert_size, block.shared_size, top_k)}


@pytest.mark.parametrize("balanced", [False, True])
def test_bytes_equal_the_planners_all_to_all_over_the_folded_group(run_ranks, balanced):
    """Per rank, op by op: the ``E/4`` split sizes from each of the 3 other
    ranks of the expert-parallel group, the rows received (routed to this
    rank's experts by all 4 ranks, and this rank's rows' outputs computed on
    the others) times ``H``, the same again backward; with balanced routing
    that is the planner's expected ``2 k N 3/4`` rows."""
    from ds_tsp.planning import moe_block_bytes_by_op

    for rank, r in enumerate(run_ranks(TSP * 2, _folded_block_bytes, balanced=balanced)):
        for direction, counted in (("forward", r["forward"]), ("both", r["total"])):
            planned = moe_block_bytes_by_op(*r["sizes"], r["tokens"], TSP, 4, direction, "all_to_all",
                                            expert_parallel_size=EP, rows_received=r["rows"])
            assert {op: c["received"] for op, c in counted.items()} == planned, (direction, counted, planned)
        if balanced:
            assert r["rows"] == 2 * r["sizes"][4] * r["tokens"] * (EP - 1) // EP
            assert planned == moe_block_bytes_by_op(*r["sizes"], r["tokens"], TSP, 4, "both", "all_to_all",
                                                    expert_parallel_size=EP)
        print(f"rank {rank} {'balanced' if balanced else 'random'} routing: {r['rows']} rows received per pass, "
              f"forward {r['forward']['all_to_all']['received']} B, with backward "
              f"{r['total']['all_to_all']['received']} B, as planned")


def _resume_folded(checkpoint_dir):
    """Four Adam steps uninterrupted, and two, save, a fresh engine, load, two:
    each rank's losses (its replica's micro-batch) both ways."""
    from test_engine import _optimizer, _step

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "tsp": {"enabled": True, "size": TSP, "expert_parallel_size": EP, "attention_backend": "sdpa"}}

    def fresh_engine():
        engine, *_ = ds_tsp.initialize(model=tiny_model("qwen3_moe", dtype=torch.float32), config=config,
                                       optimizer=_optimizer("adam"))
        return engine

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 61, (4, 16), generator=generator) for _ in range(4)]
    engine = fresh_engine()
    uninterrupted = [_step(engine, batch) for batch in batches]
    first = fresh_engine()
    before = [_step(first, batch) for batch in batches[:2]]
    first.save_checkpoint(checkpoint_dir, tag="step2")
    resumed = fresh_engine()
    resumed.load_checkpoint(checkpoint_dir, tag="step2")
    try:
        resumed.load_checkpoint(checkpoint_dir, tag="step2", load_module_only=True)
        refused = None
    except ValueError as error:
        refused = str(error)
    return dict(uninterrupted=uninterrupted, resumed=before + [_step(resumed, batch) for batch in batches[2:]],
                refused=refused)


def test_a_deepspeed_checkpoint_resumes_each_ranks_experts(run_ranks, tmp_path):
    """DeepSpeed's model states hold replica 0's experts; each rank's own come
    back from its ZeRO file's float32 masters, so the resumed run's losses are
    the uninterrupted run's bit for bit; a load of the model states alone is refused."""
    for rank, out in enumerate(run_ranks(4, _resume_folded, checkpoint_dir=str(tmp_path / "ckpt"))):
        print(f"rank {rank}: uninterrupted {out['uninterrupted']}, resumed {out['resumed']}")
        assert out["resumed"] == out["uninterrupted"]
        assert "load_optimizer_states=True and load_module_only=False" in out["refused"]
