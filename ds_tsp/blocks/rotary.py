"""Queries and keys as attention sees them: the q/k norms, then the rotary embedding.

A model's q/k norms are per head (Qwen3, Gemma-3) or over the whole
projection (OLMo-2: ``ProjectionNormPiece``); the rotary embedding runs at
the tokens' GLOBAL positions with tables from the model's own rotary module
(one per layer type where the model keeps several: Gemma-3, OLMo-3), in
Llama's (rotate-half) convention, on a head's first dims where the rotary
factor is partial (Phi-4-mini), or through the model's own function where it
computes another (``model_rotary``: GLM's, ERNIE 4.5's and Helium's
interleaved pairs; Llama 4's complex table, ``ComplexRotary``). The backward
of each, for the TSP attention's explicit backward, is here too. Queries
scaled by position after the rotary embedding (``llama_4_scaling_beta``:
Ministral 3's, Mistral 4's) take the model's own function too, and Llama 4's
NoPE layers their temperature tuning (``query_scale_of``); layers a forward
does not rotate (NoPE) take none (``rotates``).
"""

import inspect
import re
import sys
from dataclasses import dataclass

import torch


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transpose(y):
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def _rotates_part(x, cos):
    """Whether ``cos`` rotates only the first dims of ``x``'s heads (a partial
    rotary factor: its tables are shorter than the head)."""
    return cos.shape[-1] < x.shape[-1]


def apply_rotary(x, cos, sin):
    """Rotary embedding of ``x`` ``(B, S, h, d)`` with ``cos``/``sin`` ``(B, S, r)``,
    the Hugging Face (rotate-half) convention. With tables shorter than the head
    (``r < d``, a partial rotary factor) only the first ``r`` dims of each head
    rotate and the rest pass unchanged, as Hugging Face's ``apply_rotary_pos_emb`` does."""
    if _rotates_part(x, cos):
        rotary = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def apply_rotary_transpose(grad, cos, sin):
    """Gradient through ``apply_rotary`` (a linear map, so its transpose)."""
    if _rotates_part(grad, cos):
        rotary = cos.shape[-1]
        return torch.cat([apply_rotary_transpose(grad[..., :rotary], cos, sin), grad[..., rotary:]], dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return grad * cos + _rotate_half_transpose(grad * sin)


class RotateHalf:
    """Llama's rotary convention, computed by ds_tsp (``apply_rotary``)."""

    def __call__(self, x, cos, sin):
        return apply_rotary(x, cos, sin)

    def transpose(self, grad, cos, sin):
        return apply_rotary_transpose(grad, cos, sin)


ROTATE_HALF = RotateHalf()


class NoRotary:
    """A layer without a positional encoding (NoPE: Flint's and Cohere2's
    full-attention layers beside rotary sliding ones)."""

    def __call__(self, x, cos, sin):
        return x

    def transpose(self, grad, cos, sin):
        return grad


NO_ROTARY = NoRotary()


class ModelRotary:
    """The model's own ``apply_rotary_pos_emb`` on ``(B, L, h, d)`` tensors,
    called as its Hugging Face attention calls it, where it computes other
    than Llama's: neighbouring dims rotating as pairs (GLM's, ERNIE 4.5's,
    Helium's, Cohere's interleaved convention), or in float32 whatever the
    model's dtype (ERNIE 4.5's, Cohere's), so the rotated values are the
    unsharded model's to the bit.
    A rotation's transpose is the rotation by the opposite angles: backward
    calls it with ``-sin`` (``model_rotary`` checks this of the function)."""

    def __init__(self, apply):
        self.apply = apply

    def __call__(self, x, cos, sin):
        heads_first = x.transpose(1, 2)
        return self.apply(heads_first, heads_first, cos, sin)[0].transpose(1, 2)

    def transpose(self, grad, cos, sin):
        return self(grad, cos, -sin)


class ComplexRotary:
    """The model's own rotary function over a complex table (Llama 4's
    ``apply_rotary_emb(xq, xk, freqs_cis)``: neighbouring dims as the real
    and imaginary parts of one number, times ``freqs_cis`` ``(B, L, d/2)``),
    called on ``(B, L, h, d)`` tensors as its attention calls it. ds_tsp carries
    the table as its real and imaginary parts (``complex_tables``), which this
    puts back together exactly; the transpose multiplies by the conjugate."""

    def __init__(self, apply):
        self.apply = apply

    def __call__(self, x, cos, sin):
        # At least float32: autocast hands the tables over in its dtype, which torch.complex does not take.
        dtype = torch.promote_types(cos.dtype, torch.float32)
        return self.apply(x, x, torch.complex(cos.to(dtype), sin.to(dtype)))[0]

    def transpose(self, grad, cos, sin):
        return self(grad, cos, -sin)


def complex_tables(tables):
    """A rotary module's output as ``(cos, sin)``: a complex table (Llama 4's
    ``freqs_cis``) split into its real and imaginary parts, others as they are."""
    if len(tables) == 1 and tables[0].is_complex():
        return tables[0].real, tables[0].imag
    return tables


@torch.no_grad()
def model_rotary(attn, rotary_halves=False):
    """The rotary convention of the Hugging Face attention ``attn``: ``NO_ROTARY``
    for a layer its forward does not rotate (``rotates``); a ``ComplexRotary``
    of a modeling module rotating by a complex table (Llama 4's); ``ROTATE_HALF``
    where its modeling module's ``apply_rotary_pos_emb`` computes Llama's to the
    bit on a float64 probe (or tables hold each frequency once,
    ``rotary_halves``: GPT-OSS's), else a ``ModelRotary`` of that function,
    which must then be a rotation (its transpose its inverse)."""
    if not rotates(attn):
        return NO_ROTARY
    modeling = sys.modules.get(type(attn).__module__)
    apply = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply is None and "apply_rotary_emb(" in _forward_source(attn):
        return ComplexRotary(modeling.apply_rotary_emb)  # a complex table (Llama 4's); the probe checks it
    d = getattr(attn, "head_dim", 0)
    if apply is None or rotary_halves or d < 2 or d % 2:
        return ROTATE_HALF
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1, 3, 2, d, generator=generator, dtype=torch.float64)
    # Tables whose every pair of dims shares an angle both as halves and as neighbours (Llama's layout of the
    # table, each half of it repeating each angle twice), so that either convention's function is a rotation.
    angles = torch.randn(1, 3, d // 4 or 1, generator=generator, dtype=torch.float64).mul(3)
    angles = angles.repeat_interleave(2, dim=-1)[..., :d // 2]
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    own = ModelRotary(apply)
    try:
        rotated = own(x, cos, sin)
    except (RuntimeError, TypeError, ValueError):  # another signature: the layer probe judges Llama's convention
        return ROTATE_HALF
    if torch.equal(rotated, apply_rotary(x, cos, sin)):
        return ROTATE_HALF
    # <R x, y> = <x, R^T y>, and R^T y is what backward computes; 1e-5: a function computing in float32.
    if (rotated * y).sum().sub((x * own.transpose(y, cos, sin)).sum()).abs() > 1e-5 * x.numel():
        raise ValueError(f"{modeling.__name__}.apply_rotary_pos_emb ({type(attn).__name__}) is not a rotation "
                         "whose transpose rotates by the opposite angles, which the TSP attention's backward "
                         "assumes: ds_tsp does not support this attention")
    return own


# A forward that rotates only its sliding-window layers (Flint's, Cohere2's: full attention without positions), or
# those and the layers a flag of its own names (Cohere2-MoE's force_rope).
ROTARY_ON_SLIDING_LAYERS_ONLY = re.compile(r"if self\.sliding_window is not None(?: or self\.(?P<flag>\w+))?:\s+"
                                           r"(cos, sin = position_embeddings\s+)?"
                                           r"query_states, key_states = apply_rotary_pos_emb\(")


def _forward_source(attn):
    try:
        return inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        return ""


def rotates(attn):
    """Whether the Hugging Face attention ``attn``'s forward applies the rotary
    embedding: not in a layer its ``use_rope`` flag turns off (Llama 4's NoPE
    layers), nor in a full-attention layer of a model that rotates only its
    sliding-window layers (NoPE layers: Flint, Cohere2), unless the flag its
    forward reads with the window is set (Cohere2-MoE's ``force_rope``)."""
    if not getattr(attn, "use_rope", True):  # Llama 4's and SmolLM3's NoPE layers (0 in no_rope_layers)
        return False
    guarded = ROTARY_ON_SLIDING_LAYERS_ONLY.search(_forward_source(attn))
    return (guarded is None or getattr(attn, "sliding_window", None) is not None
            or bool(guarded["flag"] and getattr(attn, guarded["flag"], False)))


class Llama4QueryScale:
    """Queries scaled by position after the rotary embedding (Ministral 3's,
    Mistral 4's ``llama_4_scaling_beta``, after Llama 4's temperature tuning):
    the model's own ``get_llama_4_attn_scale``, ``(B, L)`` from position ids
    ``(B, L)``, cast to the queries' dtype before the product, as its forward casts it."""

    reads = "position_ids"
    casts_factors = True

    def __init__(self, scale, beta, max_position_embeddings):
        self.scale, self.beta, self.max_position_embeddings = scale, beta, max_position_embeddings

    def __call__(self, positions):
        return self.scale(positions, self.beta, self.max_position_embeddings)[:, 0, :, 0]


class TemperatureTuning:
    """Llama 4's attention temperature tuning of its NoPE layers: queries times
    ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` at each token's
    index ``i`` in its row as Hugging Face's forward counts it (the cache
    position: left padding counted, packed documents not restarting it), in
    float32, the product rounded once to the queries' dtype."""

    reads = "cache_positions"
    casts_factors = False

    def __init__(self, attn_scale, floor_scale):
        self.attn_scale, self.floor_scale = attn_scale, floor_scale

    def __call__(self, cache_positions):
        return torch.log1p(torch.floor((cache_positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


TEMPERATURE_TUNING = re.compile(r"if self\.attn_temperature_tuning and not self\.use_rope:")


def query_scale_of(attn, config):
    """The position-dependent query scale ``attn``'s forward applies, or None."""
    params = getattr(config, "rope_parameters", None) or {}
    modeling = sys.modules[type(attn).__module__]
    source = _forward_source(attn)
    if getattr(attn, "attn_temperature_tuning", False) and not rotates(attn) and TEMPERATURE_TUNING.search(source):
        return TemperatureTuning(attn.attn_scale, attn.floor_scale)
    if params.get("llama_4_scaling_beta") is None or "get_llama_4_attn_scale" not in source:
        return None
    return Llama4QueryScale(modeling.get_llama_4_attn_scale, params["llama_4_scaling_beta"],
                            params.get("original_max_position_embeddings"))


def query_scale_positions(scale, position_ids, cache_positions):
    """The positions the query ``scale`` reads (its ``reads``): each token's
    index in its row as Hugging Face counts it (``cache_positions``: Llama 4's
    temperature tuning), else its position id."""
    return cache_positions if scale is not None and scale.reads == "cache_positions" else position_ids


def scale_queries(q, factors, casts_factors):
    """Queries ``q`` ``(B, L, h, d)`` times ``factors`` ``(B, L)`` as the
    model's forward multiplies them: the factors cast to ``q``'s dtype first
    (``casts_factors``), or the product rounded once. Its own transpose."""
    factors = factors[:, :, None, None]
    return q * factors.to(q.dtype) if casts_factors else (q * factors).to(q.dtype)


@dataclass(frozen=True)
class ProjectionNormPiece:
    """A head group's part of an RMSNorm over a whole projection's width
    (OLMo-2's q/k norms, over ``nq*d`` and ``nkv*d`` features). Each token's
    inverse RMS over the full width comes first, as the width spans every
    rank's head groups (``attention.norms.projection_squares_forward``), so a group's
    heads are then normed alone, as Hugging Face's norm computes: in float32 or
    wider, times the weight, back to the projection's dtype."""

    weight: torch.Tensor  # (h*d,) the group's features of the norm weight
    inv_rms: torch.Tensor  # (B, L) 1 / sqrt(mean square over the full width + eps), float32 or wider

    def __call__(self, t):  # (B, L, h, d)
        scaled = t.to(self.inv_rms.dtype) * self.inv_rms[..., None, None]
        return (self.weight.view(t.shape[-2:]).to(scaled.dtype) * scaled).to(t.dtype)


def norm_rows(plan, name, j, spans_projection):
    """The features of the ``name`` (``"q"`` or ``"k"``) norm's weight that head
    group ``j`` uses: all of a per-head norm's, the group's own rows of a norm
    over the projection."""
    if not spans_projection:
        return slice(None)
    return plan.heads.q_rows(j) if name == "q" else plan.heads.kv_rows(plan.heads.kv_holder(j))


def group_norm(plan, name, j, inv_rms):
    """The ``name`` (``"q"`` or ``"k"``) norm head group ``j`` applies: the
    per-head norm itself (or None), or, given ``inv_rms`` (``{"q", "k"}``: each
    token's inverse RMS over the projection), its ``ProjectionNormPiece``."""
    norm = plan.q_norm if name == "q" else plan.k_norm
    if norm is None or inv_rms is None:
        return norm
    return ProjectionNormPiece(norm.weight[norm_rows(plan, name, j, True)], inv_rms[name])


def rotate(t, norm, cos, sin, rope=ROTATE_HALF):
    """Queries or keys as attention sees them: the q/k norm if the model
    has one, then the rotary embedding (``rope``: ``ROTATE_HALF`` or the
    model's ``ModelRotary``) at the tokens' global positions; or the other way
    round for a norm marked ``norms_after_rotary`` (Hunyuan's)."""
    if norm is None:
        return rope(t, cos, sin)
    # Back to t's dtype: under autocast t is in the autocast dtype while the
    # norm keeps its float32 weight (a no-op otherwise).
    if norms_after_rotary(norm):
        return norm(rope(t, cos, sin)).to(t.dtype)
    return rope(norm(t).to(t.dtype), cos, sin)


def norm_weight(norm):
    """A q/k norm's weight, or None for a weightless one (Llama 4's L2 norm)."""
    return getattr(norm, "weight", None)


def norms_after_rotary(norm):
    """Whether the q/k ``norm`` (a per-head Hugging Face norm module) runs on
    the rotated queries or keys (``TSPAttention.from_hf`` marks it)."""
    return getattr(norm, "tsp_after_rotary", False)


# The rotary kind of a layer that rotates nothing, in a model keeping tables per layer type (LFM3's conv layers).
UNROTATED = "unrotated"


def rotary_at(rotary_emb, hidden, positions, kind=None):
    """The model's rotary tables at ``positions`` as a tuple: ``(cos, sin)``, or
    the one complex table DeepSeek-V2 keeps; None for a model without a rotary
    embedding (``rotary_emb`` None: Granite-4.0-H's, Nemotron-H's NoPE) or layers that rotate nothing."""
    if rotary_emb is None or kind == UNROTATED:
        return None
    tables = rotary_of_kind(rotary_emb, hidden, positions, kind)
    return tables if isinstance(tables, tuple) else (tables,)


def text_and_rotary_positions(position_ids):
    """``(text positions or None, rotary positions or None)`` of ``position_ids``
    as Hugging Face passes them: ``(B, S)`` positions for everything, a VLM's
    ``(3, B, S)`` M-RoPE axes, or its ``(4, B, S)``: text positions (which
    packed documents restart), then the three axes."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids, None
    if position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    return None, position_ids


def rotary_tables(rotary_emb, hidden, positions, max_position, kind=None):
    """``rotary_at``'s tables of this rank's ``positions`` ``(B, n)`` (a VLM's
    M-RoPE axes: ``(3, B, n)``) as the model's
    rotary embedding computes them for the whole sequence (for layers of type
    ``kind``, where the model keeps a table per layer type: Gemma-3). Rotary types that
    scale with the sequence (``dynamic``) read the largest position id, so the
    full sequence's ``max_position`` ``(1, 1)``, the same on every rank, is
    appended to the positions and its row dropped from the tables. Positions
    past it (the padding TSP appends) are clamped to it: no real token sees them.
    None for a model without a rotary embedding (``rotary_emb`` None)."""
    if rotary_emb is None or kind == UNROTATED:
        return None
    probe = torch.cat([torch.minimum(positions, max_position), max_position.expand(*positions.shape[:-1], 1)],
                      dim=-1)
    return tuple(table[:, :-1] for table in rotary_at(rotary_emb, hidden, probe, kind))


def rotary_of_kind(rotary_emb, hidden, positions, kind=None):
    """The model's rotary module at ``positions``, for layers of type ``kind``
    where it keeps a table per layer type."""
    return rotary_emb(hidden, positions) if kind is None else rotary_emb(hidden, positions, kind)


def layer_rotary_tables(rotary_emb, layers, hidden, positions, max_position):
    """``rotary_tables`` for every ``rotary_kind`` among the TSP ``layers``, each computed once."""
    return {kind: rotary_tables(rotary_emb, hidden, positions, max_position, kind)
            for kind in dict.fromkeys(layer.rotary_kind for layer in layers)}


def rotate_backward(t, grad, norm, cos, sin, rope=ROTATE_HALF):
    """Gradients of ``rotate`` for its input ``t``, its norm's weight (a
    ``ProjectionNormPiece``'s rows of it) and a ``ProjectionNormPiece``'s
    inverse RMS (None where there is none; without a norm ``t`` is not read)."""
    if norm is None:
        return rope.transpose(grad, cos, sin), None, None
    with torch.enable_grad():
        # Stand-in leaves for the weight: differentiating the parameter itself
        # would run its gradient hooks (the sum over the TSP group) here too.
        t, weight = t.detach().requires_grad_(), norm_weight(norm)
        weight = None if weight is None else weight.detach().requires_grad_()
        if isinstance(norm, ProjectionNormPiece):
            leaves = (weight, norm.inv_rms.detach().requires_grad_())
            out = rope(ProjectionNormPiece(*leaves)(t), cos, sin)
        else:
            leaves = () if weight is None else (weight,)

            def normed(x):  # as rotate
                return torch.func.functional_call(norm, {"weight": weight} if leaves else {}, (x,)).to(t.dtype)
            out = normed(rope(t, cos, sin)) if norms_after_rotary(norm) else rope(normed(t), cos, sin)
        grads = torch.autograd.grad(out, (t, *leaves), grad)
    return (*grads, None, None)[:3]
