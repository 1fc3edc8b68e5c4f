"""Sparse mixture-of-experts models under TSP against the unsharded Hugging Face model.

Tiny Mixtral (4 experts), Qwen2-MoE (4 experts and a shared expert with its
gate), Qwen3-MoE (8 experts, norm_topk_prob, and a dense layer among the
MoE layers), GLM-4.5 (sigmoid scores with a score-correction bias,
group-limited top-2, routed scaling, an ungated shared expert, a dense first
layer; its router widened to float64 as tests/models.py says), OLMoE,
MiniMax-M2 (its block's score-correction bias handed to its router), and,
taken by the auto policy and its probe, dots.llm1 (GLM-4.5's block) and
Mellum (Qwen3-MoE's block, sliding and full layers with their own RoPE
tables) in float64, top-2, the auxiliary loss on where HF's forward adds one (coefficient
0.1, so its gradient matters): the loss and every gradient this rank holds match HF's at
D = 1, 2, 4, with random routing, with routing that sends every token of
every rank to experts 0 and 1 (router weights zero: all probabilities tie at
1/E and top-k takes the first, as HF's does, so every other expert receives no
token), and with right padding. One rank-pool call per D runs every case.

Bounds: the gradients and the cross-entropy are float64 sums reordered by
sharding (~1e-15), bound 1e-10 as the dense parity tests (parity.TOLERANCE).
The auxiliary loss's statistics are float32 in HF (load_balancing_loss_func
sums the routing probabilities in float32, rounding at every add); TSP sums
them exactly and rounds once, so the two agree to float32 rounding of those
sums, not to 1e-10: the aux loss is compared within aux_bound (float32 rounding
of those sums, derived from the number of terms: see there), and the loss with
it within 1e-10 plus the coefficient times that.
Its gradient does not depend on that rounding (the counts are integers), so
every gradient is held to 1e-10.
"""

import contextlib
import copy
import itertools
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import ds_tsp
from ds_tsp.parallel import comm
from ds_tsp.blocks.moe import all_to_all as moe_all_to_all
from ds_tsp.blocks.moe import module as moe
from ds_tsp.checkpoint import from_pretrained
from ds_tsp.checkpoint import save_pretrained
from ds_tsp.checkpoint.writing import write_state_dict
from ds_tsp.config import TSPConfig
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.moe.plan import shard_spec
from ds_tsp.injection.policy import POLICIES, PolicyError, resolve_policy
from ds_tsp.parallel.topology import TSPTopology
from models import MOE_ARCHS, PER_EXPERT_FILE_ARCHS, num_experts, tiny_model
from float32_control import UNIT_ROUNDOFF
from parity import TOLERANCE, shard_grad_diffs



def aux_bound(router_logits, input_ids, aux):
    """How far HF's float32 aux loss and TSP's (float64 sums rounded once) can be apart, whatever the
    summation order (so on any machine): a float32 sum of ``n`` non-negative terms errs by at most ``(n - 1) u``
    times the sum (Higham, Accuracy and Stability, 4.2; ``u`` = 2^-24). HF sums each expert's ``n = L * B * S``
    routing probabilities (L router layers, padding rows included, multiplied by 0), each first rounded to float32
    (1 u), then divides the counts and the sums by the rows (2 u), multiplies them (1 u), sums the E products
    (E - 1 u, all terms positive, so relative to the aux loss itself) and scales by E (1 u): (n + E + 4) u of the
    aux loss. TSP's rounds its exact statistics once and does the same last steps: (E + 4) u. Together
    ``(n + 2E + 8) u |aux|``."""
    layers, experts = len(router_logits), router_logits[0].shape[-1]
    return (layers * input_ids.numel() + 2 * experts + 8) * UNIT_ROUNDOFF * abs(aux)


SCHEDULES = ("ring", "all_to_all")
# (arch, batch, seq_len, right_padding, routing, model overrides)
CASES = [
    ("mixtral", 2, 16, 0, "random", {}),
    ("mixtral", 2, 13, 3, "first_experts", {}),
    ("qwen2_moe", 2, 16, 0, "random", {}),
    ("qwen2_moe", 2, 13, 3, "first_experts", {}),
    ("qwen3_moe", 2, 16, 0, "random", {"mlp_only_layers": [1], "intermediate_size": 32}),
    ("qwen3_moe", 1, 13, 4, "first_experts", {}),
    ("glm4_moe", 2, 13, 3, "random", {}),
    ("olmoe", 2, 13, 3, "random", {}),
    ("minimax_m2", 2, 13, 3, "random", {}),
    ("dots1", 2, 13, 3, "random", {}),  # two classes of their kind the issues do not name, by the auto policy
    ("mellum", 2, 13, 3, "random", {}),
    ("gpt_oss", 2, 13, 3, "random", {}),  # sinks, sliding and full layers, biased clamped experts
]


def hf_loss(ref, input_ids, attention_mask):
    """HF's loss with the auxiliary loss, but the cross-entropy in float64 (HF
    upcasts logits to float32 only): ``(loss, aux_loss, exact loss, exact aux)``,
    the last two with HF's aux formula on HF's full-sequence router logits,
    its float32 statistics summed exactly (``exact_aux``)."""
    out = ref(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_router_logits=True)
    labels = input_ids[:, 1:].clone()
    if attention_mask is not None:
        labels[attention_mask[:, 1:] == 0] = -100
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    if getattr(out, "aux_loss", None) is None:  # GLM-4.5: HF's forward adds no load-balancing loss
        return loss, None, loss.item(), None
    coef = ref.config.router_aux_loss_coef
    exact = exact_aux(out.router_logits, attention_mask, ref.config.num_experts_per_tok)
    return loss + coef * out.aux_loss, out.aux_loss, (loss + coef * exact).item(), exact.item()


def exact_aux(router_logits, attention_mask, top_k):
    """transformers' load_balancing_loss_func, every sum in float64 and rounded
    to float32 once (HF rounds at every float32 add)."""
    num_experts = router_logits[0].shape[-1]
    mask = torch.ones(router_logits[0].shape[0]) if attention_mask is None else attention_mask.reshape(-1).float()
    counts, probs = torch.zeros(num_experts, dtype=torch.float64), torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for logits in router_logits:
        weights = F.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        counts += torch.zeros(num_experts, dtype=torch.float64).scatter_add_(
            0, selected.reshape(-1), mask.repeat_interleave(top_k).double())
        probs += (weights.float() * mask.unsqueeze(-1)).double().sum(0)
        rows += mask.double().sum()
    counts, probs, rows = counts.float(), probs.float(), rows.float()
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts


def build_case(arch, batch, seq_len, right_padding, routing, overrides):
    torch.manual_seed(7)
    ref = tiny_model(arch, **overrides)
    if routing == "first_experts":
        with torch.no_grad():
            for layer in ref.model.layers:
                if hasattr(layer.mlp, "experts"):
                    layer.mlp.gate.weight.zero_()
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len))
    attention_mask = None
    if right_padding:
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, -right_padding:] = 0
    return ref, input_ids, attention_mask


def moe_parity(cases, schedules=SCHEDULES, wrong_expert_shard=False, wrong_return=False, wrong_router_bias=False,
               wrong_sinks=False, token_tile=8192):
    """On every rank, per schedule and case: |loss - HF's|, |aux - HF's| and the
    gradient diffs of ``shard_grad_diffs`` (experts, shared expert, routers
    included). ``wrong_return``: the all-to-all's outputs come back to their
    tokens reversed; ``wrong_router_bias``: the last rank's first MoE router's
    score-correction bias reversed; ``wrong_sinks``: 1 added to the last rank's
    sink logits in the first attention."""
    tsp_size = dist.get_world_size()
    results = []
    for schedule, case in itertools.product(schedules, cases):
        ref, input_ids, attention_mask = build_case(*case)
        model = copy.deepcopy(ref)
        topo = TSPTopology(tsp_size)
        ds_tsp.inject(model, topo, TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa",
                                             moe_schedule=schedule, token_tile=token_tile))
        kinds = sorted({type(layer.mlp).__name__ for layer in model.model.layers})
        moe_blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, TSPSparseMoE)]
        if wrong_expert_shard and topo.tsp_rank == tsp_size - 1:
            with torch.no_grad():
                moe_blocks[0].packed.mul_(1.5)
        if wrong_router_bias and topo.tsp_rank == tsp_size - 1:
            with torch.no_grad():
                bias = moe_blocks[0].router_module().e_score_correction_bias
                bias.copy_(bias.flip(0))
        if wrong_sinks and topo.tsp_rank == tsp_size - 1:
            attn = model.model.layers[0].self_attn
            with torch.no_grad():
                attn.spec.unpack(attn.packed)["sinks"].add_(1.0)
        with _reversed_returns() if wrong_return else contextlib.nullcontext():
            out = model(input_ids=input_ids, labels=input_ids, attention_mask=attention_mask)
        out.loss.backward()
        ref_loss, ref_aux, exact_loss, exact = hf_loss(ref, input_ids, attention_mask)
        ref_loss.backward()
        diffs = shard_grad_diffs(model, ref)
        assert (out.aux_loss is None) == (ref_aux is None)
        aux_diffs = (0.0, 0.0) if ref_aux is None else (abs(out.aux_loss.item() - ref_aux.item()),
                                                        abs(out.aux_loss.item() - exact))
        results.append({"loss": abs(out.loss.item() - ref_loss.item()), "aux": aux_diffs[0],
                        "aux_bound": 0.0 if ref_aux is None else aux_bound(out.router_logits, input_ids, ref_aux.item()),
                        "exact loss": abs(out.loss.item() - exact_loss), "exact aux": aux_diffs[1],
                        "grads": diffs, "kinds": kinds, "router_logits": [tuple(t.shape) for t in out.router_logits]})
    return results


@contextlib.contextmanager
def _reversed_returns():
    """In the all-to-all schedule's forward, the experts' outputs come back to
    their tokens in reverse order (the second of its two row exchanges)."""
    forward = moe_all_to_all.moe_all_to_all_forward

    def with_reversed_return(*args):
        exchange, calls = comm.all_to_all_rows, itertools.count()

        def rows(*exchange_args):
            received = exchange(*exchange_args)
            return received.flip(0) if next(calls) == 1 else received

        with mock.patch.object(comm, "all_to_all_rows", rows):
            return forward(*args)

    with mock.patch.object(moe_all_to_all, "moe_all_to_all_forward", with_reversed_return):
        yield


def check_case(per_rank, label, coef=0.1):
    worst_of = {key: max(r[key] for r in per_rank) for key in ("loss", "aux", "exact loss", "exact aux")}
    grads = {k: max(r["grads"][k] for r in per_rank if k in r["grads"]) for k in per_rank[0]["grads"]}
    worst = max(grads, key=grads.get)
    bound = min(r["aux_bound"] for r in per_rank)
    print(f"{label}: " + ", ".join(f"{key} {value:.2e}" for key, value in worst_of.items())
          + f" (aux bound {bound:.2e}), gradients {grads[worst]:.2e} ({worst}); blocks {per_rank[0]['kinds']}")
    assert worst_of["exact loss"] <= TOLERANCE and worst_of["exact aux"] <= TOLERANCE, worst_of
    assert worst_of["aux"] <= bound and worst_of["loss"] <= TOLERANCE + coef * bound, worst_of
    assert grads[worst] <= TOLERANCE, (worst, grads[worst])
    return grads


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_loss_aux_loss_and_every_gradient_match_hugging_face(run_ranks, tsp_size):
    """Under both schedules; "first_experts" routes every token to experts 0 and
    1, so the other experts' owners get no row, and at D = 2 (and Qwen3-MoE's
    8 experts at D = 4) every token of every rank goes to rank 0."""
    per_rank = run_ranks(tsp_size, moe_parity, cases=CASES)
    for i, (schedule, case) in enumerate(itertools.product(SCHEDULES, CASES)):
        results = [rank[i] for rank in per_rank]
        grads = check_case(results, f"D={tsp_size} {schedule} {case[0]} B={case[1]} S={case[2]} pad={case[3]} "
                                    f"{case[4]}")
        names = " ".join(grads)
        assert "experts.gate_up_proj" in names and ("mlp.gate.weight" in names or "mlp.router.weight" in names)
        if case[0] == "qwen2_moe":
            assert "shared_expert.down_proj.weight" in names and "shared_expert_gate.weight" in names
        if case[0] == "glm4_moe":
            assert "shared_experts.down_proj.weight" in names
        if case[5].get("mlp_only_layers") or case[0] == "glm4_moe":
            assert results[0]["kinds"] == ["TSPGatedMLP", "TSPSparseMoE"]
        # The local tokens' logits: (B * padded S / D, E) per MoE layer.
        padded = -(-case[2] // (2 * tsp_size)) * 2 * tsp_size
        assert all(shape[0] == case[1] * padded // tsp_size for shape in results[0]["router_logits"])


def full_router_logits(cases):
    """On every rank, per case: the largest |TSP's - HF's| over the router logits
    of every MoE layer, asked for in the forward (HF's ``(B*S, E)`` layout), and
    the shapes TSP returned."""
    tsp_size, results = dist.get_world_size(), []
    for case in cases:
        ref, input_ids, attention_mask = build_case(*case)
        model = copy.deepcopy(ref)
        ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
        mine = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True).router_logits
        hf = ref(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                 output_router_logits=True).router_logits
        # HF's attention masks padded keys from padded queries too, TSP's only from real ones: the rows of
        # right padding (attention_mask 0) differ, and neither model uses them.
        real = torch.ones(input_ids.numel(), dtype=torch.bool) if attention_mask is None else \
            attention_mask.reshape(-1).bool()
        # A loss of the user's own from the logits (HF's load-balancing loss, computed alike on every rank)
        # reaches the routers as in HF: each rank's own tokens' part, summed over the group with the routers'
        # other replicated gradients.
        top_k = ref.config.num_experts_per_tok
        for logits in (mine, hf):
            load_balancing_loss_func(logits, logits[0].shape[-1], top_k, attention_mask).backward()
        routers = {name: p.grad for name, p in ref.named_parameters() if name.endswith(".gate.weight")}
        mine_routers = {name: p.grad for name, p in model.named_parameters() if name.endswith(".gate.weight")}
        results.append({"shapes": [tuple(t.shape) for t in mine], "hf_shapes": [tuple(t.shape) for t in hf],
                        "diff": max((a - b)[real].abs().max().item() for a, b in zip(mine, hf)),
                        "spread": min((b - b.mean(0)).abs().max().item() for b in hf),
                        "routers": sorted(mine_routers) == sorted(routers) and len(routers) > 0,
                        "router_grad_diff": max((mine_routers[n] - g).abs().max().item() for n, g in routers.items()),
                        "router_grad_scale": max(g.abs().max().item() for g in routers.values())})
    return results


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_router_logits_asked_for_are_hugging_faces(run_ranks, tsp_size):
    """``output_router_logits=True`` in the forward: every MoE layer's logits over
    the whole sequence, in HF's order and shape (TSP's padding dropped, rows for
    HF's right padding kept), equal to HF's at every real token."""
    cases = [("mixtral", 2, 13, 3, "random", {}), ("qwen2_moe", 1, 13, 4, "random", {}), CASES[4]]
    for rank, results in enumerate(run_ranks(tsp_size, full_router_logits, cases=cases)):
        for case, result in zip(cases, results):
            print(f"D={tsp_size} rank {rank} {case[0]} B={case[1]} S={case[2]}: router logits {result['shapes']}, "
                  f"max|diff| {result['diff']:.2e} over the real tokens")
            assert result["shapes"] == result["hf_shapes"]
            assert result["diff"] <= TOLERANCE
            assert result["spread"] > 1e-3  # the tokens' logits differ, so a wrong order would show
            print(f"    routers' gradients from HF's load-balancing loss of them: max|diff| "
                  f"{result['router_grad_diff']:.2e} (scale {result['router_grad_scale']:.2e})")
            assert result["routers"]
            # A gradient summed over ranks (D times too large) or none at all would be off by the scale.
            assert result["router_grad_diff"] <= TOLERANCE < 1e-3 * result["router_grad_scale"]


def test_token_tiles_change_no_number(run_ranks):
    """Three local tokens at a time through each expert (and the shared expert's
    ring), under both schedules at D = 2: ragged tiles, numbers as HF's."""
    cases = [CASES[0], CASES[2]]
    per_rank = run_ranks(2, moe_parity, cases=cases, token_tile=3)
    for i, (schedule, case) in enumerate(itertools.product(SCHEDULES, cases)):
        check_case([rank[i] for rank in per_rank], f"D=2 token_tile=3 {schedule} {case[0]}")


@pytest.mark.parametrize("wrong", ["expert shard ring", "expert shard all_to_all", "return all_to_all",
                                   "router bias ring", "sinks ring", "GPT-OSS expert shard ring"])
def test_a_wrong_expert_shard_router_bias_sink_or_return_permutation_is_caught(run_ranks, wrong):
    what, schedule = wrong.rsplit(" ", 1)
    arch = {"router bias": "glm4_moe", "sinks": "gpt_oss", "GPT-OSS expert shard": "gpt_oss"}.get(what)
    cases = [case for case in CASES if case[0] == arch] if arch else CASES[:1]
    per_rank = run_ranks(2, moe_parity, cases=cases, schedules=(schedule,),
                         wrong_expert_shard=what.endswith("expert shard"), wrong_return=what == "return",
                         wrong_router_bias=what == "router bias", wrong_sinks=what == "sinks")
    worst = max(max(r[0]["grads"].values()) for r in per_rank)
    loss = max(r[0]["loss"] for r in per_rank)
    print(f"wrong {what} ({schedule}): loss {loss:.2e}, gradients {worst:.2e}")
    assert loss > 1e3 * TOLERANCE and worst > 1e3 * TOLERANCE


def test_experts_indivisible_by_tsp_size_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"num_experts 6 is not divisible by tsp.size 4.*\[1, 2, 3, 6\]"):
        shard_spec(16, 6, 8, 4)


def test_moe_layers_resolve_to_their_tables_and_jitter_is_refused():
    for arch in MOE_ARCHS:
        assert resolve_policy(tiny_model(arch)).name == (arch if arch in POLICIES else "auto")
    with pytest.raises(PolicyError, match="router_jitter_noise"):
        resolve_policy(tiny_model("mixtral", router_jitter_noise=0.1))


def test_a_router_that_returns_another_layout_is_refused_at_injection():
    """Llama 4's router returns (scores, logits): a router of any policy that
    does not return HF's (logits, weights, indices) is refused, naming it,
    before the first forward."""
    model = tiny_model("qwen3_moe")
    gate_class = type(model.model.layers[0].mlp.gate)

    class ScoresFirst(gate_class):
        def forward(self, hidden_states):
            logits, weights, _ = super().forward(hidden_states)
            return weights, logits

    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.__class__ = ScoresFirst
    with pytest.raises(PolicyError, match=r"Qwen3MoeDecoderLayer.mlp.gate: ScoresFirst does not return Hugging "
                                          r"Face's \(logits, weights, indices\)"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1, attention_backend="sdpa"))


def test_the_load_balancing_loss_is_added_where_hugging_faces_forward_adds_it():
    """Mixtral's (and a subclass's whose forward calls it), none for GLM-4.5,
    and Doge's own function, which ds_tsp does not compute, refused by name
    when the config asks for it."""
    from transformers import DogeConfig, DogeForCausalLM, Glm4MoeForCausalLM, MixtralForCausalLM

    from ds_tsp.injection.policy import check_load_balancing, load_balancing_loss

    class Subclassed(MixtralForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert load_balancing_loss(MixtralForCausalLM) == load_balancing_loss(Subclassed) == "switch"
    assert load_balancing_loss(Glm4MoeForCausalLM) is None and load_balancing_loss(DogeForCausalLM) == "other"
    with pytest.raises(PolicyError, match=r"DogeForCausalLM adds a load-balancing loss other than Mixtral's.*"
                                          r"output_router_logits = False"):
        check_load_balancing(DogeForCausalLM, DogeConfig(output_router_logits=True))
    check_load_balancing(DogeForCausalLM, DogeConfig(output_router_logits=False))


# ------------------------------------------------------------------ bytes

def _block_and_tokens(arch, dtype, schedule, balanced):
    """Layer 0's MoE block of a tiny model, and tokens ``(2, 8, H)`` for it.
    ``balanced``: token ``i`` of every rank is routed to experts ``ki .. ki+k-1``
    (mod E), so each rank sends every other rank exactly ``k N / D`` rows."""
    topo = TSPTopology(dist.get_world_size())
    ref = tiny_model(arch, dtype=getattr(torch, dtype))
    block = TSPSparseMoE.from_hf(ref.model.layers[0].mlp, topo.tsp_group, schedule=schedule)
    torch.manual_seed(11 + topo.tsp_rank)
    x = torch.randn(2, 8, ref.config.hidden_size, dtype=block.packed.dtype)
    if balanced:
        x = _balanced_routing(block, x, ref.config.num_experts_per_tok)
    return block, x, ref.config.num_experts_per_tok


def _count(block, x):
    """Bytes counted in the block's forward, then its forward + backward."""
    x = x.clone().requires_grad_()
    comm.counter.reset()
    out = block(x)
    forward = comm.counter.snapshot()
    out.backward(torch.randn_like(out))
    return forward, comm.counter.snapshot()


def _counted(arch, dtype):
    """One MoE block's bytes on the ring: forward, forward + backward, and its shard's numel and element size."""
    block, x, _ = _block_and_tokens(arch, dtype, "ring", False)
    return (*_count(block, x), block.packed.numel(), block.packed.element_size())


def _balanced_routing(block, x, top_k):
    """Tokens ``x`` (and ``block``'s router) such that token ``i`` chooses experts
    ``ki .. ki+k-1`` (mod E): the router reads the first ``E`` hidden features,
    and those are 10 for the chosen experts, 0 for the others."""
    num_experts = block.num_experts
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :num_experts] = torch.eye(num_experts)
        x = x.clone()
        x[..., :num_experts] = 0
        flat = x.view(-1, x.shape[-1])
        for i in range(flat.shape[0]):
            flat[i, [(top_k * i + j) % num_experts for j in range(top_k)]] = 10
    return x


def _exchanged_rows(block, x):
    """Rows this rank receives in one all-to-all forward, from every rank's
    routing of its own tokens: the rows others route to this rank's experts and
    the outputs of this rank's rows computed elsewhere."""
    _, _, index = block.gate(x.reshape(-1, x.shape[-1]))
    owner = index.reshape(-1) // (block.num_experts // block.tsp_size)
    sends = torch.bincount(owner, minlength=block.tsp_size)  # rows this rank sends to each rank
    every = [torch.empty_like(sends) for _ in range(block.tsp_size)]
    dist.all_gather(every, sends)
    rank = block.tsp_rank
    return int(sum(every[j][rank] for j in range(block.tsp_size) if j != rank) + sends.sum() - sends[rank])


def _counted_all_to_all(arch, dtype, balanced):
    """``_count`` under the all-to-all schedule, a forward without gradients, and
    the rows received per pass counted from every rank's routing."""
    block, x, top_k = _block_and_tokens(arch, dtype, "all_to_all", balanced)
    rows = _exchanged_rows(block, x)
    forward, total = _count(block, x)
    comm.counter.reset()
    with torch.no_grad():
        block(x)
    return {"forward": forward, "total": total, "no_grad": comm.counter.snapshot(), "rows": rows,
            "sizes": (block.hidden_size, block.num_experts, block.expert_size, block.shared_size, top_k,
                      x.shape[0] * x.shape[1]), "element": block.packed.element_size()}


def _auto_choices():
    """What "auto" runs for few and many local tokens, in training and eval
    mode, the planner's choice for each, and the log lines it wrote."""
    import logging

    from ds_tsp.planning import cheaper_moe_schedule

    block, _, top_k = _block_and_tokens("qwen3_moe", "float64", cheaper_moe_schedule, False)
    moe._announced.clear()  # this worker's earlier tests may have announced these shapes already
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ds_tsp").addHandler(handler)
    logging.getLogger("ds_tsp").setLevel(logging.INFO)
    choices = []
    try:
        for tokens in (8, 8, 4096):
            for training in (True, False):
                block.train(training)
                x = torch.randn(tokens, block.hidden_size, dtype=torch.float64)
                comm.counter.reset()
                with torch.no_grad():
                    block(x.unsqueeze(0))
                ran = "all_to_all" if "all_to_all" in comm.counter.snapshot() else "ring"
                planned = cheaper_moe_schedule(block.hidden_size, block.num_experts, block.expert_size, 0, top_k,
                                               tokens, block.tsp_size, 8, "both" if training else "forward")
                choices.append((tokens, training, ran, planned))
    finally:
        logging.getLogger("ds_tsp").removeHandler(handler)
    return choices, [r.getMessage() for r in records]


def test_auto_runs_the_schedule_the_cost_model_picks_and_says_so_once(run_ranks):
    """Qwen3-MoE's tiny block at D = 2: "auto" sends 8 local tokens by all-to-all and
    takes the ring for 4096, as ``cheaper_moe_schedule`` says (forward and
    backward in training mode, forward alone in eval); rank 0 logs each choice once."""
    for rank, (choices, logged) in enumerate(run_ranks(2, _auto_choices)):
        print(f"rank {rank}: {choices}; logged {logged}")
        assert all(ran == planned for _, _, ran, planned in choices)
        assert {ran for tokens, _, ran, _ in choices if tokens == 8} == {"all_to_all"}
        assert {ran for tokens, _, ran, _ in choices if tokens == 4096} == {"ring"}
        assert logged == ([] if rank else ["tsp.moe_schedule auto: all_to_all for 8 local tokens (E=8, top-2, D=2)",
                                           "tsp.moe_schedule auto: ring for 4096 local tokens (E=8, top-2, D=2)"])


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_all_to_all_bytes_equal_the_formula_and_the_planners(run_ranks, tsp_size):
    """Per rank: forward the split sizes (``E/D`` int64 from each other rank) and
    the rows received (``_exchanged_rows``, from the routing) times ``H``;
    backward the same rows again; Qwen2-MoE's shared expert on the ring. With
    balanced routing that is the planner's expected ``2 k N (D-1)/D`` rows."""
    from ds_tsp.planning import moe_block_bytes_by_op

    for arch, dtype in (("qwen2_moe", "float64"), ("mixtral", "bfloat16"), ("qwen3_moe", "float32")):
        for balanced in (False, True):
            per_rank = run_ranks(tsp_size, _counted_all_to_all, arch=arch, dtype=dtype, balanced=balanced)
            for rank, r in enumerate(per_rank):
                hidden, experts, _, shared, top_k, tokens = r["sizes"]
                e = r["element"]
                splits = (tsp_size - 1) * experts // tsp_size * 8
                assert r["no_grad"]["all_to_all"]["received"] == r["rows"] * hidden * e + splits
                assert r["total"]["all_to_all"]["received"] == 2 * r["rows"] * hidden * e + splits
                assert r["total"]["all_to_all"]["calls"] == 5  # split sizes, rows, outputs; their gradients
                assert set(r["total"]) == ({"all_to_all", "ring"} if shared else {"all_to_all"}), r["total"]
                for direction, counted in (("forward", r["forward"]), ("both", r["total"])):
                    planned = moe_block_bytes_by_op(*r["sizes"][:5], tokens, tsp_size, e, direction, "all_to_all",
                                                    rows_received=r["rows"])
                    assert {op: c["received"] for op, c in counted.items()} == planned, (direction, planned)
                    if balanced:
                        assert r["rows"] == 2 * top_k * tokens * (tsp_size - 1) // tsp_size
                        assert planned == moe_block_bytes_by_op(*r["sizes"][:5], tokens, tsp_size, e, direction,
                                                                "all_to_all")
                print(f"D={tsp_size} rank {rank} {arch} {dtype} {'balanced' if balanced else 'random'} routing: "
                      f"{r['rows']} rows received per pass, {r['total']['all_to_all']['received']} B all-to-all")


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_ring_bytes_equal_the_formula(run_ranks, tsp_size):
    for arch, dtype in (("qwen2_moe", "float64"), ("mixtral", "bfloat16")):
        for forward, total, numel, size in run_ranks(tsp_size, _counted, arch=arch, dtype=dtype):
            acc = 8 if dtype == "float64" else 4  # accumulators travel in float32 or wider
            assert set(total) == {"ring"}, total  # no all-to-all, no all-reduce in the block
            assert forward["ring"]["received"] == (tsp_size - 1) * numel * size
            assert total["ring"]["received"] == (tsp_size - 1) * numel * (2 * size + acc)
            assert total["ring"]["sent"] == total["ring"]["received"]
            print(f"D={tsp_size} {arch} {dtype}: shard {numel} elements, forward {forward['ring']['received']} B, "
                  f"forward+backward {total['ring']['received']} B received")


# ------------------------------------------------------------ checkpoints

def _load_and_save(src, dst):
    """``from_pretrained`` (this rank's experts only), then ``save_pretrained``
    (every block gathered, rank 0 writes); returns the expert shapes held here."""
    tsp_size = dist.get_world_size()
    model = from_pretrained(src, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size,
                                                                   attention_backend="sdpa"))
    held = {f"layer {index}": {n: t.shape for n, t in layer.mlp.spec.unpack(layer.mlp.packed.detach()).items()}
            for index, layer in enumerate(model.model.layers) if isinstance(layer.mlp, TSPSparseMoE)}
    save_pretrained(model, dst)
    return held


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_from_pretrained_reads_own_experts_and_round_trips_bit_exact(run_ranks, tmp_path, tsp_size):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for arch in MOE_ARCHS:
        src, dst, hf = (str(tmp_path / f"{arch}-{kind}") for kind in ("src", tsp_size, "hf"))
        ref = tiny_model(arch)
        # write_state_dict writes the experts one tensor per expert, as transformers' save_pretrained does;
        # ds_tsp reads them back. What Hugging Face writes after loading the same files is the reference: it
        # keeps GLM-4.5's router (its weight and score-correction bias) in float32, and so does ds_tsp.
        write_state_dict(src, ref.state_dict(), ref.config)
        loaded = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, experts_implementation="eager")
        loaded.save_pretrained(hf)
        held = run_ranks(tsp_size, _load_and_save, src=src, dst=dst)
        first = next(iter(held[0].values()))
        assert first["experts.gate_up_proj"][0] == num_experts(ref.config) // tsp_size
        expected, actual = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(dst,
                                                                                                 "model.safetensors"))
        assert sorted(actual) == sorted(expected)
        for name in expected:
            assert torch.equal(actual[name], expected[name]), name


# ------------------------------------ Hub checkpoints: one tensor per expert

def _recording_open_safetensors(read):
    """``open_safetensors`` (``safe_open`` for PyTorch) that appends to ``read`` the name of every
    tensor whose data is read (``get_tensor``, a slice's ``[...]``), not headers."""
    import contextlib

    from safetensors import safe_open

    class Slice:
        def __init__(self, piece, name):
            self.piece, self.name = piece, name

        def get_shape(self):
            return self.piece.get_shape()

        def __getitem__(self, index):
            read.append(self.name)
            return self.piece[index]

    class File:
        def __init__(self, f):
            self.f = f

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            return Slice(self.f.get_slice(name), name)

    @contextlib.contextmanager
    def recording(file):
        with safe_open(file, framework="pt") as f:
            yield File(f)

    return recording


def _per_expert_parity(per_expert, fused):
    """Load ``per_expert`` (transformers' file layout) recording what is read,
    and ``fused``; their parameters, the expert tensors read, and the loss,
    aux loss and gradients against HF's model loaded from ``per_expert``."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from ds_tsp.checkpoint import reading

    tsp_size = dist.get_world_size()
    topology, tsp_config = TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa")
    read = []
    with mock.patch.object(reading, "open_safetensors", _recording_open_safetensors(read)):
        model = from_pretrained(per_expert, topology, tsp_config)
    loaded, expected = model.state_dict(), from_pretrained(fused, topology, tsp_config).state_dict()
    differ = sorted(set(loaded) ^ set(expected)) + [n for n in expected if n in loaded
                                                    and not torch.equal(loaded[n], expected[n])]
    ref = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float64, experts_implementation="eager")
    # Both keep GLM-4.5's router in float32 as HF loads it, and its weight's gradient, a float32 sum over tokens,
    # would be float32-exact only: widened to float64 in both (the files are under test here, not the router).
    for routers in ([l.mlp.router_module() for l in model.model.layers if isinstance(l.mlp, TSPSparseMoE)],
                    [l.mlp.gate for l in ref.model.layers if hasattr(l.mlp, "experts")]):
        for router in routers:
            router.double()
    torch.manual_seed(3)
    input_ids = torch.randint(0, ref.config.vocab_size, (2, 16))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    ref_loss, ref_aux, exact_loss, exact = hf_loss(ref, input_ids, None)
    ref_loss.backward()
    assert (out.aux_loss is None) == (ref_aux is None)
    aux_diffs = (0.0, 0.0) if ref_aux is None else (abs(out.aux_loss.item() - ref_aux.item()),
                                                    abs(out.aux_loss.item() - exact))
    return {"read": [name for name in read if _expert_of(name) is not None], "differ": differ,
            "loss": abs(out.loss.item() - ref_loss.item()), "aux": aux_diffs[0],
            "aux_bound": 0.0 if ref_aux is None else aux_bound(out.router_logits, input_ids, ref_aux.item()),
            "exact loss": abs(out.loss.item() - exact_loss), "exact aux": aux_diffs[1],
            "grads": shard_grad_diffs(model, ref), "kinds": sorted({type(l.mlp).__name__ for l in model.model.layers})}


def _expert_of(name):
    """The expert of a per-expert file name (``...experts.{e}.w1.weight``), else None."""
    import re

    match = re.search(r"\.experts\.(\d+)\.", name)
    return None if match is None else int(match[1])


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", PER_EXPERT_FILE_ARCHS)
def test_from_pretrained_reads_hub_per_expert_files_own_experts_only(run_ranks, tmp_path, arch, tsp_size):
    """transformers' save_pretrained writes experts one tensor per expert (Mixtral's
    block_sparse_moe.experts.{e}.w1/w2/w3, Qwen's mlp.experts.{e}.gate/up/down_proj),
    as Hub checkpoints hold them; here in several files with an index. Each rank
    reads exactly its own experts' tensors, holds bit for bit what the fused
    layout gives it, and its loss and gradients equal HF's from the same files."""
    import json

    from safetensors.torch import save_file

    ref = tiny_model(arch)
    per_expert, fused = str(tmp_path / "per_expert"), str(tmp_path / "fused")
    ref.save_pretrained(per_expert, max_shard_size="8KB")
    with open(os.path.join(per_expert, "model.safetensors.index.json")) as f:
        names = list(json.load(f)["weight_map"])
    assert not any("gate_up_proj" in name for name in names)
    ref.config.save_pretrained(fused)
    save_file({n: t.contiguous() for n, t in ref.state_dict().items()}, os.path.join(fused, "model.safetensors"),
              metadata={"format": "pt"})

    per_rank = run_ranks(tsp_size, _per_expert_parity, per_expert=per_expert, fused=fused)
    per_rank_experts = num_experts(ref.config) // tsp_size
    for tsp_rank, result in enumerate(per_rank):
        own = [name for name in names if _expert_of(name) is not None
               and _expert_of(name) // per_rank_experts == tsp_rank]
        assert sorted(result["read"]) == sorted(own), tsp_rank
        assert result["differ"] == [], result["differ"]
    print(f"D={tsp_size} {arch}: {len(per_rank[0]['read'])} of "
          f"{sum(_expert_of(n) is not None for n in names)} expert tensors read on rank 0")
    check_case(per_rank, f"D={tsp_size} {arch} from per-expert files")
