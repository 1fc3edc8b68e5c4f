"""The sparse MoE block's router logits and Hugging Face's auxiliary
load-balancing loss over the whole sequence.

``router_logits``: with ``output_router_logits`` passed to the forward, per
MoE layer the whole sequence's ``(B*S, E)`` as Hugging Face returns them
(``full_sequence_router_logits``: one all-gather for all layers); when only the
config turns them on (the load-balancing loss in training), the local tokens'
``(B*S/D, E)`` in this rank's token order (zigzag shard), which is all the
loss needs, so training gathers nothing. The loss (``load_balancing_loss``)
adds one all-reduce of ``2E+1`` float64 values per forward.
"""

import contextlib

import torch
import torch.nn.functional as F

from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.eager import EagerFunction
from ds_tsp.parallel.mappings import sum_over_group


def router_logits_of(output):
    """The logits ``(N, E)`` in a Hugging Face router's output: first of
    ``(logits, weights, indices)``, last of Llama 4's ``(scores, logits)``."""
    return output[1] if len(output) == 2 else output[0]


@contextlib.contextmanager
def recorded_router_logits(blocks):
    """Collect each ``TSPSparseMoE`` router's logits ``(N, E)`` during the
    forward inside, in layer order, as Hugging Face's ``OutputRecorder`` does
    (a forward hook on the router). Yields the list."""
    logits = []
    handles = [block.router_module().register_forward_hook(
        lambda module, args, output: logits.append(router_logits_of(output))) for block in blocks]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


class _FullSequenceRows(EagerFunction):
    """Forward: every rank's ``(..., S/D, E)`` rows (dim -2) all-gathered into
    natural order, TSP's padding dropped. Backward: each rank keeps the
    gradient of its own rows, as every rank computes the same loss from the
    same gathered rows (``sum_over_group``'s rule, not a sum over ranks)."""

    @staticmethod
    def forward(ctx, local, group, num_padding, layout_name):
        ctx.group, ctx.layout_name = group, layout_name
        dim = local.dim() - 2
        gathered, _ = comm.all_gather(local, group)  # (D, ..., S/D, E)
        return layout.unpad(layout.unshard(gathered, comm.group_size(group), layout_name, dim=dim), num_padding,
                            dim=dim)

    @staticmethod
    def backward(ctx, grad):
        tsp_size, dim = comm.group_size(ctx.group), grad.dim() - 2
        padded, _ = layout.pad_to_multiple(grad, tsp_size, 0.0, dim=dim)
        return layout.shard(padded, comm.group_rank(ctx.group), tsp_size, ctx.layout_name, dim=dim), None, None, None


def full_sequence_router_logits(router_logits, batch_size, num_padding, group, layout_name):
    """Hugging Face's layout of ``router_logits`` (per MoE layer this rank's
    ``(B*S/D, E)``): per layer ``(B*S, E)`` over the whole sequence in natural
    order, the padding TSP appends dropped. One all-gather for all layers;
    differentiable, so a loss computed from them (HF's
    ``load_balancing_loss_func``) reaches the routers as it does in HF."""
    num_experts = router_logits[0].shape[-1]
    local = torch.stack([logits.view(batch_size, -1, num_experts) for logits in router_logits])  # (L, B, S/D, E)
    natural = _FullSequenceRows.apply(local, group, num_padding, layout_name)
    return tuple(layer.reshape(-1, num_experts) for layer in natural.unbind(0))


def load_balancing_loss(router_logits, top_k, real, group):
    """Hugging Face's ``load_balancing_loss_func`` over the whole sequence.

    ``router_logits``: per MoE layer, this rank's ``(N, E)`` logits;
    ``real``: ``(N,)`` bool, this rank's real tokens (not padding, HF's or
    TSP's). HF's statistics are sums over every token of every layer
    (``routing_statistics``): each rank sums its own tokens, one all-reduce
    over the TSP group adds them, and every rank computes the same loss
    (``balance_loss``). Its gradient reaches each rank's own tokens'
    probabilities (``sum_over_group``'s identity backward), as the
    cross-entropy's does.
    """
    return balance_loss(sum(routing_statistics(logits, real, top_k) for logits in router_logits), group)


def routing_statistics(logits, real, top_k):
    """One MoE layer's share of the load-balancing statistics over this rank's
    real tokens: ``(2E+1,)`` float64, how often each expert is in a token's
    top-k, the sum of its softmax probabilities, and the number of rows.
    Summing them over layers (and pipeline stages) gives HF's statistics.

    Dtypes as HF: softmax and top-k in the logits' dtype, the probabilities
    float32. The sums run in float64 and are rounded to float32 once
    (``balance_loss``), so the result does not depend on ``D`` or the token
    order; HF rounds at every float32 add, so the two agree to float32
    rounding of the statistics.
    """
    mask = real.reshape(-1).to(device=logits.device, dtype=torch.float32)
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device)
    counts.scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(top_k).double())
    prob_sum = (probs.float() * mask.unsqueeze(-1)).double().sum(0)
    return torch.cat([counts, prob_sum, mask.double().sum().view(1)])


def balance_loss(statistics, group):
    """The load-balancing loss from this rank's summed ``routing_statistics``:
    one all-reduce of ``2E+1`` float64 values over the TSP group, then HF's
    ``E * sum(fraction routed * mean probability)``."""
    num_experts = statistics.shape[0] // 2
    stats = sum_over_group(statistics, group)
    counts, prob_sum, rows = stats[:num_experts].float(), stats[num_experts:-1].float(), stats[-1].float()
    return torch.sum((counts / rows) * (prob_sum / rows).unsqueeze(0)) * num_experts
