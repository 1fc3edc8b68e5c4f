"""bf16 fidelity against float64, as the TSP size grows: the unsharded Hugging
Face model (D = 1), TSP and DeepSpeed-Ulysses at D = 2, 4 and 8, on CPU gloo ranks.

    python benchmarks/fidelity.py                              # the committed run (benchmarks/results/fidelity.md)
    python benchmarks/fidelity.py --sizes 2 --seq-len 512 --out /tmp/fid   # a smoke run
    python benchmarks/fidelity.py --loss-batches 24 --strategies tsp_bf16_sums --name fidelity_bf16_sums

One small Llama-shaped model (hidden 64, 2 layers, 8 heads, 8 key/value heads,
vocabulary 512) and a fixed batch of ``--seq-len`` tokens per sample (4096: 512 tokens
per rank at D = 8). bf16 as DeepSpeed runs it: the weights the forward uses are
the bf16 copies of fp32 master weights, activations and gradients are bf16.
The reference is the SAME model (those bf16 weights, exactly, widened) computed
in float64, so every difference below is arithmetic, none is weight rounding.

Per case: the relative error ``||x_bf16 - x_f64|| / ||x_f64||`` of the loss, of
every token's loss (the vector the loss is the mean of), of each decoder
layer's output (every token) and of the gradient of each group of
parameters: the embedding, each layer's attention weights and MLP weights, the
norms (all RMSNorm weights) and the LM head. Sharded gradients are compared
piece by piece with the matching slices of the reference (the squared errors of
the pieces add up over the ranks), replicated ones once.

* ``hf``: the unsharded model, one process, its own loss (logits in fp32);
* ``tsp``: ``ds_tsp.inject`` at ``tsp.size = D`` (folded vocabulary, zigzag);
* ``tsp_fp32_wire``: the same with the one sum TSP sends in bf16 and adds in
  fp32 on arrival from partials that were fp32 (the dK/dV reduce-scatter) sent
  in fp32 instead: what keeping bf16 on the wire costs. (The norms' gradients
  also travel in bf16, but autograd hands them over in bf16 already.)
* ``tsp_bf16_wire``: ``tsp`` with the parameter-gradient partial sums (the
  attention's weight-gradient reduces, the MLP and LM-head rings'
  accumulators) sent in bf16 and added in fp32 on arrival, as a config that
  sets ``"communication_data_type": "bf16"`` has them: what halving those
  bytes costs. (Unset, they travel in fp32, as in ``tsp``.)
* ``tsp_bf16_sums``: ``tsp`` in the long-sequence setting,
  ``tsp.fp32_accumulators: false`` and ``tsp.recompute_norms: true``: the head
  groups' outputs, the MLP ring steps, the input gradients and a head group's
  dK/dV add up in bf16 instead of in fp32 cast once. The forward's sums change
  too, so its loss row is measured. ``recompute_norms`` runs each RMSNorm again
  in backward on the same input and changes no number: what this measures is
  ``fp32_accumulators`` off.
* ``tsp_long``: ``tsp`` as ``ds-tsp plan --max-seq-len`` plans it, sums in
  fp32: every layer recomputed in backward from its input in host memory,
  ``tsp.recompute_norms: true`` (the attention norms its input tile by tile
  in backward) and ``tsp.token_tile`` of 128 tokens (several MLP, query and
  norm tiles per rank at every D).
* ``ulysses``: ``UlyssesSPAttentionHF`` at ``sequence_parallel_size = D``, rank
  ``r`` holding the ``r``-th contiguous chunk (as ``benchmarks/compare.py``
  feeds it), the loss the sum of the ranks' fp32 sums over the real-token
  count. The per-rank gradients of the replicated weights are summed over the
  SP group in fp32, as DeepSpeed's bf16 optimizer reduces its fp32 gradient
  copies.

The table in ``fidelity.md`` gives each error and its ratio to the unsharded
model's; the check is TSP's ratio <= 1.1 for the loss, the token losses and
every gradient group at every D. The scalar loss's error of one batch is one
number, a sum of 4095 per-token errors of either sign, so two equally accurate
computations that round differently land anywhere in a wide band (it is ~1e-6,
a thousand times below bf16's unit roundoff). So every figure is pooled over
``--samples`` independent samples (weights and batch drawn from seeds
``--seed``, ``--seed + 1``, ...): squared errors and squared reference norms
are summed over the samples before the ratio. For the scalar loss that is not
enough: over 4 samples of 2048 tokens the unsharded model's signed loss errors
were +0.9, +2.7, +1.9, -3.4 (x 1e-5) and TSP's at D = 2 -1.6, +0.9, +4.8, -1.2:
uncorrelated draws of one spread, whose ratio over 4 samples lands anywhere
in 0.7-1.5. The loss row therefore also pools ``--loss-batches`` more batches
per sample, forward only, and the table states the standard error that is left.
The token losses remain the stable measure of the loss's accuracy. Ulysses computes every token exactly as
the unsharded model does, so its loss error is the same number.
"""

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
IGNORE_INDEX = -100
LIMIT = 1.1  # TSP's error may be at most this times the unsharded model's


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=176)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4,
                        help="independent (weights, batch) samples, seeds --seed, --seed+1, ...; errors pooled")
    parser.add_argument("--loss-batches", type=int, default=32,
                        help="more batches per sample whose scalar loss (forward only) the loss row pools over")
    parser.add_argument("--strategies", nargs="+", default=["tsp", "tsp_fp32_wire", "tsp_bf16_wire", "ulysses"])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--name", default="fidelity")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per D")
    parser.add_argument("--redraw", action="store_true", help="rewrite the table and plot from --out's JSON")
    return parser.parse_args(argv)


# --- the model, the batch and the error measure --------------------------------------------------------------------

def build_model(args, dtype):
    """The same weights everywhere: HF's init, rounded to bf16 (the forward's
    copy of the fp32 master weights), then held in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    return model.to(dtype)


def batch_ids(args):
    generator = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (1, args.seq_len), generator=generator)


def loss_batches(args):
    """The ``--loss-batches`` more batches of a sample (seeds apart from every sample's own)."""
    return [torch.randint(0, args.vocab, (1, args.seq_len),
                          generator=torch.Generator().manual_seed(10_000 * (args.seed + 1) + b))
            for b in range(args.loss_batches)]


def group_of(name):
    """The gradient group of a Hugging Face parameter name."""
    if "norm" in name:
        return "norms"
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    layer = name.split(".")[2]
    return f"layer{layer}.{'attention' if '.self_attn.' in name else 'mlp'}"


class Errors:
    """Squared error and squared reference norm per quantity, summed over
    pieces (and, through ``merge``, over ranks)."""

    def __init__(self):
        self.sums = {}

    def add(self, key, value, reference):
        value, reference = value.double(), reference.double()
        err, ref = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (err + (value - reference).pow(2).sum().item(), ref + reference.pow(2).sum().item())

    @staticmethod
    def merge(parts):
        """The sums of several ``sums`` dicts (ranks, or samples)."""
        total = {}
        for sums in parts:
            for key, (err, ref) in sums.items():
                e, r = total.get(key, (0.0, 0.0))
                total[key] = (e + err, r + ref)
        return total

    @staticmethod
    def relative(sums):
        """``||x - ref|| / ||ref||`` per quantity, over everything summed."""
        return {key: math.sqrt(err / ref) for key, (err, ref) in sums.items()}


def token_losses(logits, input_ids, dtype):
    """Every token's cross-entropy ``(S,)`` against the next token (0 for the last)."""
    labels = F.pad(input_ids, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return F.cross_entropy(logits.to(dtype).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none")


def layer_outputs(layers, store):
    """Forward hooks keeping every decoder layer's output in ``store``."""
    def hook(index):
        def keep(module, inputs, output):
            store[index] = (output[0] if isinstance(output, tuple) else output).detach()
        return keep
    return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]


def run_reference(args):
    """The float64 truth and the unsharded bf16 model: the same forward and backward."""
    input_ids = batch_ids(args)
    results, models = {}, {}
    for dtype in (torch.float64, torch.bfloat16):
        model = models[dtype] = build_model(args, dtype)
        outputs = {}
        hooks = layer_outputs(model.model.layers, outputs)
        if dtype == torch.float64:  # HF's own loss would cast float64 logits down to float32
            logits = model(input_ids=input_ids).logits
            per_token = token_losses(logits, input_ids, torch.float64)
            loss = per_token.sum() / (input_ids.numel() - 1)
        else:
            out = model(input_ids=input_ids, labels=input_ids)
            loss, per_token = out.loss, token_losses(out.logits.detach(), input_ids, torch.float32)
        loss.backward()
        for hook in hooks:
            hook.remove()
        results[dtype] = {"loss": loss.detach().double(), "token_losses": per_token.detach().double(),
                          "outputs": outputs, "grads": {n: p.grad for n, p in model.named_parameters()}}
    ref, bf16 = results[torch.float64], results[torch.bfloat16]
    errors = Errors()
    errors.add("loss", bf16["loss"], ref["loss"])
    ref["loss_batches"] = []
    with torch.no_grad():
        for ids in loss_batches(args):
            f64_logits = models[torch.float64](input_ids=ids).logits
            f64_loss = token_losses(f64_logits, ids, torch.float64).sum() / (ids.numel() - 1)
            ref["loss_batches"].append((ids, f64_loss))
            errors.add("loss", models[torch.bfloat16](input_ids=ids, labels=ids).loss.double(), f64_loss)
    errors.add("token_losses", bf16["token_losses"], ref["token_losses"])
    for index, out in ref["outputs"].items():
        errors.add(f"layer{index}.output", bf16["outputs"][index], out)
    for name, grad in ref["grads"].items():
        errors.add(group_of(name), bf16["grads"][name], grad)
    return ref, errors.sums


# --- the sharded cases, one process per rank ---------------------------------------------------------------------

def tsp_errors(args, ref, tsp_size, grad_wire_dtype=None, host_checkpoints=False, **tsp_options):
    """TSP's errors; ``tsp_options`` are further ``tsp`` config keys;
    ``host_checkpoints``: every layer recomputed in backward from its input in
    host memory (``cpu_checkpointing``)."""
    import ds_tsp
    from ds_tsp.parallel import layout
    from ds_tsp.blocks import vocab
    from ds_tsp.config import TSPConfig
    from ds_tsp.runtime.engine import set_grad_wire_dtype
    from ds_tsp.runtime.offload import host_checkpoint
    from ds_tsp.parallel.topology import TSPTopology

    input_ids = batch_ids(args)
    model = build_model(args, torch.bfloat16)
    topo = TSPTopology(tsp_size)
    config = TSPConfig(enabled=True, size=tsp_size, layout="zigzag", attention_backend="sdpa", **tsp_options)
    ds_tsp.inject(model, topo, config)
    set_grad_wire_dtype(model, grad_wire_dtype)
    if host_checkpoints:
        model.train()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint)
    outputs, per_token = {}, []
    hooks = layer_outputs(model.model.layers, outputs)
    ring_loss = vocab._CrossEntropyRing.apply

    def keep_token_losses(*inputs):  # the fused head + loss's per-token losses, before their sum
        losses = ring_loss(*inputs)
        per_token.append(losses.detach())
        return losses

    vocab._CrossEntropyRing.apply = keep_token_losses
    try:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    finally:
        vocab._CrossEntropyRing.apply = ring_loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    rank, errors = topo.tsp_rank, Errors()
    if rank == 0:
        errors.add("loss", loss.detach(), ref["loss"])
    with torch.no_grad():
        for ids, ref_loss in ref["loss_batches"]:
            batch_loss = model(input_ids=ids, labels=ids).loss
            if rank == 0:
                errors.add("loss", batch_loss, ref_loss)
    errors.add("token_losses", per_token[0], layout.shard(ref["token_losses"][None], rank, tsp_size, "zigzag")[0])
    for index, out in outputs.items():
        errors.add(f"layer{index}.output", out, layout.shard(ref["outputs"][index], rank, tsp_size, "zigzag"))
    grads = ref["grads"]
    for name, param in model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False) and rank == 0:  # replicated: count once
            errors.add(group_of(name), param.grad, grads[name])
    for name in ("model.embed_tokens", "lm_head"):
        module = model.get_submodule(name)
        dim, start, length = module.shard_piece("weight")
        errors.add(group_of(name), module.weight.grad[:length], grads[f"{name}.weight"].narrow(dim, start, length))
    for index, layer in enumerate(model.model.layers):
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name)
            for name, grad in block.spec.unpack(block.packed.grad).items():
                full = grads[f"model.layers.{index}.{block_name}.{name}"]
                errors.add(f"layer{index}.{'attention' if block_name == 'self_attn' else 'mlp'}", grad,
                           full.narrow(*block.shard_piece(name)))
    return errors.sums


def tsp_fp32_wire_errors(args, ref, tsp_size):
    """``tsp_errors`` with the dK/dV reduce-scatter sent in fp32."""
    from ds_tsp.blocks.attention import schedule as attention
    from ds_tsp.parallel import comm, precision

    scatter_kv_grads = attention.scatter_kv_grads

    def in_fp32(plan, dKV, dtype):
        pending = scatter_kv_grads(plan, dKV, precision.accumulation_dtype(dtype))
        return comm.Pending(None, lambda: tuple(t.to(dtype) for t in pending.wait()))

    attention.scatter_kv_grads = in_fp32
    try:  # the forward is TSP's own, so its loss row would be TSP's: left out
        sums = tsp_errors(args, {**ref, "loss_batches": []}, tsp_size)
    finally:
        attention.scatter_kv_grads = scatter_kv_grads
    sums.pop("loss", None)
    return sums


def tsp_bf16_wire_errors(args, ref, tsp_size):
    """``tsp_errors`` with the parameter-gradient partial sums sent in bf16."""
    # The forward is TSP's own, so its loss row would be TSP's: left out.
    sums = tsp_errors(args, {**ref, "loss_batches": []}, tsp_size, grad_wire_dtype=torch.bfloat16)
    sums.pop("loss", None)
    return sums


def ulysses_errors(args, ref, sp_size):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    input_ids = batch_ids(args)
    model = build_model(args, torch.bfloat16)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp_size,
        micro_batch_size=1, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    rank = dist.get_rank(group)
    seq_len = input_ids.shape[1]
    chunk = seq_len // sp_size
    own = slice(rank * chunk, (rank + 1) * chunk)
    labels = F.pad(input_ids, (0, 1), value=IGNORE_INDEX)[:, 1:][:, own]
    outputs = {}
    hooks = layer_outputs(model.model.layers, outputs)
    logits = model(input_ids=input_ids[:, own], position_ids=torch.arange(seq_len)[None, own]).logits
    local_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    count = seq_len - 1  # every token but the last has a label
    (local_sum / count).backward()
    for hook in hooks:
        hook.remove()
    loss = local_sum.detach().clone()
    dist.all_reduce(loss, group=group)
    errors = Errors()
    if rank == 0:
        errors.add("loss", loss / count, ref["loss"])
    with torch.no_grad():
        for ids, ref_loss in ref["loss_batches"]:
            batch_logits = model(input_ids=ids[:, own], position_ids=torch.arange(seq_len)[None, own]).logits
            batch_sum = F.cross_entropy(batch_logits.float().flatten(0, 1),
                                        F.pad(ids, (0, 1), value=IGNORE_INDEX)[:, 1:][:, own].flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
            dist.all_reduce(batch_sum, group=group)
            if rank == 0:
                errors.add("loss", batch_sum / count, ref_loss)
    errors.add("token_losses", F.cross_entropy(logits.detach().float().flatten(0, 1), labels.flatten(),
                                               ignore_index=IGNORE_INDEX, reduction="none"), ref["token_losses"][own])
    for index, out in outputs.items():
        errors.add(f"layer{index}.output", out, ref["outputs"][index][:, own])
    for name, param in model.named_parameters():
        grad = param.grad.float()
        dist.all_reduce(grad, group=group)
        if rank == 0:
            errors.add(group_of(name), grad.to(param.dtype), ref["grads"][name])
    return errors.sums


LONG_TOKEN_TILE = 128
STRATEGIES = {"tsp": tsp_errors, "tsp_fp32_wire": tsp_fp32_wire_errors, "tsp_bf16_wire": tsp_bf16_wire_errors,
              "tsp_bf16_sums": functools.partial(tsp_errors, fp32_accumulators=False, recompute_norms=True),
              "tsp_long": functools.partial(tsp_errors, recompute_norms=True, token_tile=LONG_TOKEN_TILE,
                                            host_checkpoints=True),
              "ulysses": ulysses_errors}


def _worker(rank, world, rendezvous, reference_file, args, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        import deepspeed

        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout))
        deepspeed.init_distributed(dist_backend="gloo")
        ref = torch.load(reference_file)
        for strategy in args.strategies:
            start = time.perf_counter()
            sums = STRATEGIES[strategy](args, ref, world)
            results.put((rank, strategy, sums, time.perf_counter() - start))
            dist.barrier()
        results.put((rank, "done", None, None))
    except Exception:
        import traceback
        results.put((rank, "error", traceback.format_exc(), None))
    results.close()
    results.join_thread()  # the queue's feeder thread must flush before the hard exit
    os._exit(0)  # without tearing gloo down: ranks that leave first sometimes abort the others


def run_size(world, reference_file, args):
    # Ranks are forked from a fork server that imported this script (torch, DeepSpeed, ds_tsp) once for the whole
    # run, not spawned afresh for every sample and size; never forked from this process, whose float64 reference
    # ran on OpenMP threads.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds_tsp_fidelity_") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "rdzv"), reference_file, args, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        per_strategy, seconds, done = {}, {}, 0
        while done < world:
            rank, kind, value, wall = results.get(timeout=args.timeout)
            if kind == "error":
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"rank {rank} of D={world} failed:\n{value}")
            if kind == "done":
                done += 1
                continue
            per_strategy.setdefault(kind, []).append(value)
            seconds[kind] = max(seconds.get(kind, 0.0), wall)
        for proc in procs:
            proc.join(timeout=30)
    return {name: Errors.merge(sums) for name, sums in per_strategy.items()}, seconds


# --- table and plot ------------------------------------------------------------------------------------------------

def ordered_keys(errors):
    keys = list(errors)
    first = ["loss", "token_losses"] + sorted(k for k in keys if k.endswith(".output"))
    grads = ["embedding"] + sorted(k for k in keys if k.startswith("layer") and not k.endswith(".output")) + \
        ["norms", "lm_head"]
    return [k for k in first + grads if k in keys]


def is_gradient(key):
    return key not in ("loss", "token_losses") and not key.endswith(".output")


def checked(result):
    """The TSP cases held to ``LIMIT``: those with a forward of their own (a
    loss row); the wire variants' forward is ``tsp``'s."""
    sharded = result["sharded"].values()
    names = dict.fromkeys(name for cases in sharded for name in cases)
    return [name for name in names if name.startswith("tsp") and all("loss" in cases[name] for cases in sharded
                                                                     if name in cases)]


def verdicts(result, strategy):
    """Per D and quantity (loss and gradient groups): ``strategy``'s error
    over the unsharded model's, and whether it is within ``LIMIT``."""
    base = result["hf"]
    out = {}
    for size, cases in result["sharded"].items():
        errors = cases.get(strategy)
        if errors is not None:
            out[size] = {k: {"ratio": errors[k] / base[k], "within": errors[k] <= LIMIT * base[k]}
                         for k in ordered_keys(base) if not k.endswith(".output")}
    return out


def draws(args):
    """How many scalar-loss errors the loss row pools."""
    return args.samples * (1 + args.loss_batches)


def markdown(result, args):
    base, sizes = result["hf"], sorted(result["sharded"], key=int)
    strategies = [s for s in args.strategies if any(s in result["sharded"][d] for d in sizes)]
    lines = ["# bf16 fidelity against float64 (`benchmarks/fidelity.py`)", "",
             f"Llama-shaped: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} "
             f"key/value heads, MLP {args.intermediate}, vocabulary {args.vocab}; {args.samples} samples (seeds "
             f"{args.seed}..{args.seed + args.samples - 1}: weights and batch), each one sequence of {args.seq_len} "
             f"tokens ({args.seq_len // max(int(d) for d in sizes)} per rank at D = {max(int(d) for d in sizes)}); "
             "errors pooled over the samples (squared errors and squared norms summed); the scalar loss also over "
             f"{args.loss_batches} more batches per sample (forward only), {draws(args)} draws in all, so its ratios "
             f"carry a standard error of about {1 / math.sqrt(draws(args)):.2f} (two independent RMS estimates). "
             "bf16 weights (the bf16 copy of fp32 masters), activations and gradients; the reference is the same "
             "weights in float64. Relative error `||x_bf16 - x_f64|| / ||x_f64||`; in brackets, the ratio to the "
             f"unsharded model's (D = 1). TSP passes where that ratio is at most {LIMIT} for the loss and every "
             "gradient group.", ""]
    for strategy in strategies:
        lines += [f"**{strategy}**", "", "| quantity | D=1 (HF) | " + " | ".join(f"D={d}" for d in sizes) + " |",
                  "|---|---|" + "---|" * len(sizes)]
        for key in ordered_keys(base):
            row = [key, f"{base[key]:.3e}"]
            for d in sizes:
                value = result["sharded"][d].get(strategy, {}).get(key)
                row.append("-" if value is None else f"{value:.3e} ({value / base[key]:.2f}x)")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    for strategy in checked(result):
        checks = verdicts(result, strategy)
        sizes = sorted(checks, key=int)
        label = "TSP" if strategy == "tsp" else f"`{strategy}`"
        lines += [f"{label}'s error over the unsharded model's, within {LIMIT}x (loss and every gradient group), "
                  f"and its growth from D={sizes[0]} to D={sizes[-1]}:", "",
                  "| group | " + " | ".join(f"D={d}" for d in sizes) + f" | D={sizes[-1]} / D={sizes[0]} |",
                  "|---|" + "---|" * (len(sizes) + 1)]
        for key in checks[sizes[0]]:
            cells = [f"{checks[d][key]['ratio']:.2f}x {'yes' if checks[d][key]['within'] else '**no**'}"
                     for d in sizes]
            growth = checks[sizes[-1]][key]["ratio"] / checks[sizes[0]][key]["ratio"]
            lines.append(f"| {key} | " + " | ".join(cells) + f" | {growth:.2f} |")
        lines.append("")
    return "\n".join(lines)


TOP = 1.4  # the plot's ratio axis ends here


def plot(result, args, path):
    """One panel per strategy: each quantity's error over the unsharded model's, against D."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, sizes = result["hf"], sorted(result["sharded"], key=int)
    keys = [k for k in ordered_keys(base) if not k.endswith(".output")]
    strategies = [s for s in args.strategies if any(s in result["sharded"][d] for d in sizes)]
    fig, axes = plt.subplots(1, len(strategies), figsize=(5 * len(strategies), 4.2), squeeze=False, sharey=True)
    xs = [1] + [int(d) for d in sizes]
    for ax, strategy in zip(axes[0], strategies):
        for key in keys:
            if any(key not in result["sharded"][d][strategy] for d in sizes):
                continue  # the wire variants' loss: their forward is tsp's own
            ys = [1.0] + [result["sharded"][d][strategy][key] / base[key] for d in sizes]
            line, = ax.plot(xs, [min(y, TOP) for y in ys], marker="o", label=key,
                            linestyle=":" if "loss" in key else "-")
            for x, y in zip(xs, ys):
                if y > TOP:  # off the scale (the scalar loss): its value at the top edge
                    ax.annotate(f"{key} {y:.2f}x", (x, TOP), textcoords="offset points", xytext=(-30, -12),
                                fontsize=7, color=line.get_color())
        ax.axhline(LIMIT, color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0.6, TOP + 0.02)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("D (1: the unsharded HF model)")
        ax.set_title(strategy)
    axes[0][0].set_ylabel(f"bf16 error / unsharded bf16 error (dashed: {LIMIT})")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("bf16 relative error against float64, over the unsharded model's")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(result, args):
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(markdown(result, args))
    plot(result, args, os.path.join(args.out, f"{args.name}.png"))


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.redraw:  # tables and plot again from the JSON of a run
        with open(os.path.join(args.out, f"{args.name}.json")) as f:
            result = json.load(f)
        args = argparse.Namespace(**{**result["args"], "out": args.out, "name": args.name})
        write_results(result, args)
        return
    start = time.perf_counter()
    base_sums, sharded_sums, seconds_by_size = [], {}, {}
    for sample in range(args.samples):
        sample_args = argparse.Namespace(**{**vars(args), "seed": args.seed + sample})
        ref, sums = run_reference(sample_args)
        base_sums.append(sums)
        with tempfile.TemporaryDirectory(prefix="ds_tsp_fidelity_ref_") as tmp:
            reference_file = os.path.join(tmp, "reference.pt")
            torch.save(ref, reference_file)
            for size in args.sizes:
                size_start = time.perf_counter()
                per_strategy, _ = run_size(size, reference_file, sample_args)
                for strategy, strategy_sums in per_strategy.items():
                    sharded_sums.setdefault(str(size), {}).setdefault(strategy, []).append(strategy_sums)
                seconds_by_size[str(size)] = seconds_by_size.get(str(size), 0.0) + time.perf_counter() - size_start
        print(f"sample {sample + 1}/{args.samples} done ({time.perf_counter() - start:.0f} s)", flush=True)
    base = Errors.relative(Errors.merge(base_sums))
    result = {"args": vars(args), "hf": base, "seconds": {"total": time.perf_counter() - start, **seconds_by_size},
              "sharded": {size: {strategy: Errors.relative(Errors.merge(parts)) for strategy, parts in cases.items()}
                          for size, cases in sharded_sums.items()}}
    for size, cases in result["sharded"].items():
        for strategy, errors in cases.items():
            print(f"D={size} {strategy}: ratio to D=1 {json.dumps({k: f'{v / base[k]:.2f}' for k, v in errors.items()})}")
    for strategy in checked(result):
        result[f"{strategy}_within_limit"] = verdicts(result, strategy)
    write_results(result, args)
    print(markdown(result, args))


if __name__ == "__main__":
    main()
