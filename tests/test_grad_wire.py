"""The wire dtype of TSP's parameter-gradient partial sums (the attention's
weight-gradient reduces; the MLP, MoE and LM-head rings' accumulators): sent
in bf16 where DeepSpeed's ``communication_data_type`` says so, added in
float32 on arrival; float32 by default; float64 models keep float64."""

import torch
import torch.distributed as dist

from ds_tsp.parallel import comm

SEQ, BATCH = 16, 2
# A float32 model whose partials go in bf16: each partial (or running ring sum) is rounded once to bf16 before
# it is added, a relative error of at most 2^-9 of it, and at most D-1 = 3 of them reach a sum; partials here
# are of the sum's size, so the sum's norm-wise error stays near 3 * 2^-9 = 6e-3 (measured: up to 2.5e-3 at D = 4).
# 1e-2 holds that with room; a wrong sum (a partial lost or counted twice) is off by ~1 (1/D of the gradient).
BF16_WIRE_BOUND = 1e-2
# ... and well above float32 round-off (~1e-7): the bf16 wire is really rounding, the check can see it.
ROUNDING_SEEN = 1e-5


def _sharded_grads_and_bytes(cases):
    """Per ``(arch, dtype)``: a tiny injected model's sharded gradients (packed
    shards, vocabulary shards) and the backward's bytes per op, with the default
    wire, a bf16 wire, and the default again (the same numbers twice)."""
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.runtime.engine import set_grad_wire_dtype
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_model

    D = dist.get_world_size()
    results = []
    for arch, dtype in cases:
        model = inject(tiny_model(arch, dtype=dtype), TSPTopology(D),
                       TSPConfig(enabled=True, size=D, attention_backend="sdpa", check_batch="never",
                                 moe_schedule="ring"))  # the experts on the wire, with their gradients
        torch.manual_seed(3)  # the same batch on every rank
        input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        runs = {}
        for label, wire in (("default", None), ("bf16", torch.bfloat16), ("default again", None)):
            set_grad_wire_dtype(model, wire)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=input_ids, labels=input_ids).loss
            comm.counter.reset()
            loss.backward()
            runs[label] = dict(grads={name: param.grad.clone() for name, param in model.named_parameters()
                                      if getattr(param, "tensor_model_parallel", False)},
                               bytes=comm.counter.snapshot())
        results.append(runs)
    return results


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_a_bf16_wire_halves_those_bytes_and_keeps_the_gradients_to_bf16(run_ranks):
    for D, cases in ((2, [("llama", torch.float32), ("mixtral", torch.float32), ("llama", torch.float64)]),
                     (4, [("llama", torch.float32)])):
        for rank, per_case in enumerate(run_ranks(D, _sharded_grads_and_bytes, cases=cases)):
            for (arch, dtype), runs in zip(cases, per_case):
                default, bf16 = runs["default"], runs["bf16"]
                assert all(torch.equal(g, runs["default again"]["grads"][n]) for n, g in default["grads"].items())
                errors = {name: _relative(bf16["grads"][name], g) for name, g in default["grads"].items()}
                received = {label: {op: c["received"] for op, c in run["bytes"].items()} for label, run in runs.items()}
                print(f"D={D} {arch} {dtype} rank {rank}: bf16 wire's gradients, max rel error "
                      f"{max(errors.values()):.2e}; backward bytes received {received['bf16']} (default wire: "
                      f"{received['default']})")
                if dtype == torch.float64:  # float64 keeps float64: the same bytes, the same bits
                    assert bf16["bytes"] == default["bytes"] and max(errors.values()) == 0
                    continue
                # The embedding's row gradients are activation gradients, sent back in the model's dtype as
                # before; every packed shard (attention, MLP or experts) and the head's rows went by the wire.
                assert errors.pop("model.embed_tokens.weight") == 0
                assert ROUNDING_SEEN < min(errors.values()) and max(errors.values()) < BF16_WIRE_BOUND, errors
                # The reduce exactly halved; the ring's backward moves D-1 weight hops (4 B an element, unchanged)
                # and D-1 accumulator hops of the same shards (4 B -> 2 B): 3/4 of its bytes. Nothing else moves.
                expected = {**default["bytes"]}
                expected["reduce"] = {**default["bytes"]["reduce"], "sent": default["bytes"]["reduce"]["sent"] // 2,
                                      "received": default["bytes"]["reduce"]["received"] // 2}
                expected["ring"] = {**default["bytes"]["ring"], "sent": default["bytes"]["ring"]["sent"] * 3 // 4,
                                    "received": default["bytes"]["ring"]["received"] * 3 // 4}
                assert bf16["bytes"] == expected
