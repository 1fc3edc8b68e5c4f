"""A block's input norm, recomputed inside the block tile by tile (``tsp.recompute_norms``).

A decoder layer norms its input before the attention (Llama's
``input_layernorm``). Kept as a module of its own, the norm's output is a
``(B, S/D, H)`` tensor that the attention keeps for its backward; recomputed
by torch's checkpoint it is still rebuilt whole there. Inside the attention
(``ds_tsp.blocks.attention.schedule``) the norm runs on the layer's input instead: the
forward norms it once, and backward norms a tile of local tokens at a time
wherever it needs the normed values (each head group's projections and their
weight gradients), so no ``(B, S/D, H)`` copy of them exists in backward; the
gradient of the normed values, summed over the head groups, goes back through
the norm tile by tile too. The numbers are Hugging Face's norm's: its own
module computes every tile (with stand-in leaves for its weight in backward),
and its gradient arrives in the dtype the unfused norm's output has.

Norms whose only parameter is ``weight`` (the RMSNorms of Llama, Qwen,
Mistral, Gemma...) are recomputed so; others, and norms whose weight ZeRO-3
partitions (it gathers a module's parameters only when the module itself
runs), stay modules of their own.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.parallel import precision


def recomputable(norm):
    """Whether ``norm`` can run inside a block: its only parameter is a weight
    that this rank holds whole (not partitioned by ZeRO-3)."""
    params = dict(norm.named_parameters())
    return set(params) == {"weight"} and not hasattr(params["weight"], "ds_id")


@dataclass(frozen=True)
class TiledInputNorm:
    """Hugging Face's ``module`` applied to ``(N, H)`` local tokens, tiles of
    ``tile`` tokens at a time (0: all at once), with ``weight`` (the module's,
    as the block's autograd Function received it) and its output cast to
    ``dtype`` (the block's compute dtype: the autocast dtype under autocast)."""

    module: nn.Module
    weight: torch.Tensor
    dtype: torch.dtype
    tile: int = 0

    def tiles(self, num_tokens):
        size = max(self.tile or num_tokens, 1)
        return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]

    def _norm(self, tokens, weight):
        """Hugging Face's norm of ``tokens``, in the dtype its module returns."""
        return torch.func.functional_call(self.module, {"weight": weight}, (tokens,))

    def _apply(self, tokens, weight):
        return self._norm(tokens, weight).to(self.dtype)

    def __call__(self, tokens):
        """The normed ``tokens`` (no graph)."""
        with torch.no_grad():
            return self._apply(tokens, self.weight)

    def project(self, tokens, weight, bias=None):
        """``F.linear`` of the normed ``tokens`` ``(N, H)``, normed a tile at a time."""
        out = tokens.new_empty((tokens.shape[0], weight.shape[0]), dtype=weight.dtype)
        for start, end in self.tiles(tokens.shape[0]):
            out[start:end] = F.linear(self(tokens[start:end]), weight, bias)
        return out

    def weight_gradient(self, grad, tokens, out):
        """A projection's weight gradient ``grad.T @ normed tokens`` into ``out``
        (float32 or wider, ``precision.partial_matmul``), normed a tile at a time."""
        for start, end in self.tiles(tokens.shape[0]):
            precision.partial_matmul(grad[start:end].t(), self(tokens[start:end]), out=out, add=start > 0)

    def backward(self, tokens, grad):
        """``(grad_tokens, grad_weight)`` from ``grad`` ``(N, H)`` of the normed
        ``tokens`` (any dtype: cast first to the dtype the module's output has,
        as autograd hands the unfused norm its output's gradient: float32 under
        autocast, where the projections cast the normed values); the weight's
        gradient summed over the tiles in float32 or wider."""
        grad_tokens = torch.empty_like(tokens)
        grad_weight = torch.zeros(self.weight.shape, dtype=torch.promote_types(self.weight.dtype, torch.float32),
                                  device=self.weight.device)
        for start, end in self.tiles(tokens.shape[0]):
            with torch.enable_grad():
                # A stand-in leaf for the weight: differentiating the parameter itself would run its hooks here.
                tile, weight = tokens[start:end].detach().requires_grad_(), self.weight.detach().requires_grad_()
                normed = self._norm(tile, weight)
                tile_grad, weight_grad = torch.autograd.grad(normed, (tile, weight), grad[start:end].to(normed.dtype))
            grad_tokens[start:end] = tile_grad
            grad_weight += weight_grad
        return grad_tokens, grad_weight.to(self.weight.dtype)
