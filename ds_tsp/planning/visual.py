"""What a vision-language model's tower costs a training step (DESIGN.md 6m): its
size (``VisionShape``, read off Hugging Face's model built on the meta device),
its memory per device and its bytes per TSP rank.

Under TSP each rank of the group encodes its share of the micro-batch's
patches, about ``1/D``, with the tower's (and projector's) parameters held
``1/D`` per rank FSDP-style (``ds_tsp.blocks.tower``). Per rank and step, beside
the text decoder's bytes (``communication.tsp_step_bytes_by_op``):

* ``all_gather``, forward: every tower unit's flat vector, ``D-1`` slices of
  ``ceil(numel / D)`` elements each (and again for the units recomputed in
  backward, under activation checkpointing);
* ``reduce_scatter``, backward: the same slices of the units' gradients;
* ``all_to_all``: the merged visual rows this rank receives for its
  placeholder tokens from the ranks that encoded them (forward), and the
  gradients of the rows it encoded for other ranks' tokens (backward),
  ``features x H`` elements a row (Qwen3-VL's deepstack features ride
  beside the merged rows: ``features`` = 1 + their count).

Where the rows go depends on where the batch's placeholders sit: the
``rows_exchanged`` pair (received forward, received backward) is exact for a
given batch, by default the expected ``(D-1)/D`` of the ``visual_rows / D``
rows a rank holds, for placeholders spread evenly over the ranks.

The baselines (DeepSpeed-Ulysses with or without ZeRO-3, DP/ZeRO, TP, CP) run
the tower whole on every device of a model replica over all the micro-batch's
patches: DeepSpeed-Ulysses takes a text config only, and verl's Ulysses path
runs the whole tower for every image on every rank. ZeRO partitions its states
over the replicas as it does the decoder's.

The planner is a leaf of the package and loads no torch until a config is
planned: torch and transformers are imported here, when a tower is built.
"""

import functools
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from ds_tsp.planning.memory import STATES, model_states
from ds_tsp.planning.shapes import FLOAT32

# Where each family keeps its tower and projector (ds_tsp.injection.policy.VISION_TOWERS, which the planner, a
# leaf, does not import): Qwen's model.visual holds its mergers; the others' projector sits beside the tower.
TOWER_PATHS = (("model.visual",), ("model.vision_tower", "model.multi_modal_projector"))
# A Qwen frame as the default video is sampled: 448 x 448 pixels (Qwen's processors resize to multiples of
# patch x merge; 448 is one of 16 x 2 and 14 x 2). Towers of one image size (CLIP, SigLIP, Pixtral) use theirs.
QWEN_FRAME_PIXELS = 448

# The tower's terms of a plan's peak (``StrategyPlan.terms``).
TOWER_STATES = "vision tower model states"
TOWER_ACTIVATIONS = "vision tower saved tensors"
TOWER_BACKWARD = "vision tower backward"


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's tower and projector (merger), as the planner costs them."""

    params: int  # the tower's and projector's parameters
    unit_numels: tuple  # each unit's (ds_tsp.blocks.tower.tower_units): what TSP gathers and scatters at once
    recomputed_numels: tuple  # of those, the blocks a checkpointed tower runs again in backward
    layers: int  # transformer blocks of the tower
    hidden_size: int  # the tower's width
    intermediate_size: int
    num_heads: int
    mlp_gated: bool  # gate and up projections (Qwen2.5-VL's tower); else fc1, act, fc2
    patches_per_token: int  # patches merged into one visual token
    features: int  # rows sent per visual token: 1 + Qwen3-VL's deepstack features
    text_hidden_size: int
    frame_tokens: int  # visual tokens of one default frame (``QWEN_FRAME_PIXELS``, or the tower's image size)

    @property
    def largest_unit(self):
        return max(self.unit_numels)

    def held_params(self, tsp_size):
        """Parameters one of ``tsp_size`` ranks holds: ``ceil(numel / D)`` of every unit."""
        return sum(math.ceil(numel / tsp_size) for numel in self.unit_numels)


def vision_shape(fields):
    """``VisionShape`` of the vision-language config ``fields`` (a config's dict, with
    ``model_type``, ``text_config`` and ``vision_config``); None for a text-only config."""
    if not isinstance(fields.get("vision_config"), dict) or "model_type" not in fields:
        return None
    return _vision_shape(json.dumps({k: v for k, v in fields.items() if k != "name"}, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _vision_shape(key):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.modeling_layers import GradientCheckpointingLayer

    fields = {name: value for name, value in json.loads(key).items() if name != "architectures"}
    try:
        config = AutoConfig.for_model(**fields)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except Exception as err:  # noqa: BLE001 - any config transformers does not build: say which
        raise ValueError(f"the planner cannot build the vision tower of model_type {fields['model_type']!r} "
                         f"({type(err).__name__}: {err})") from None
    paths = next(paths for paths in TOWER_PATHS if _submodule(model, paths[0]) is not None)
    units = [unit for path in paths for unit in _tower_units(model.get_submodule(path))]
    vision = config.vision_config
    width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL's hidden_size is the decoder's
    block = next(unit for unit in units if isinstance(unit, GradientCheckpointingLayer))
    merge = getattr(vision, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None) or 1
    qwen = paths == TOWER_PATHS[0]
    patches_per_token = merge ** 2 if qwen or config.model_type == "mistral3" else 1
    if getattr(config, "mm_tokens_per_image", None):  # Gemma 3 pools each image's patches to this many tokens
        patches_per_token = (vision.image_size // vision.patch_size) ** 2 // config.mm_tokens_per_image
    side = getattr(vision, "image_size", None) or QWEN_FRAME_PIXELS
    return VisionShape(
        params=sum(sum(p.numel() for p in unit.parameters()) for unit in units),
        unit_numels=tuple(sum(p.numel() for p in unit.parameters()) for unit in units),
        recomputed_numels=tuple(sum(p.numel() for p in unit.parameters()) for unit in units
                                if isinstance(unit, GradientCheckpointingLayer)),
        layers=sum(isinstance(unit, GradientCheckpointingLayer) for unit in units),
        hidden_size=width,
        intermediate_size=getattr(vision, "intermediate_size", None) or int(width * vision.mlp_ratio),
        num_heads=getattr(vision, "num_heads", None) or vision.num_attention_heads,
        mlp_gated=any(name.endswith("gate_proj") for name, _ in block.named_modules()),
        patches_per_token=patches_per_token,
        features=1 + len(getattr(vision, "deepstack_visual_indexes", None) or ()),
        text_hidden_size=config.get_text_config().hidden_size,
        frame_tokens=(side // vision.patch_size) ** 2 // patches_per_token)


def _submodule(model, path):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _tower_units(tower):
    """The modules ``ds_tsp.blocks.tower.shard_tower`` makes units of (its rule, restated here: the planner
    imports nothing of the package): a tower without blocks holding parameters of its own is one unit; else
    each child holding parameters, a ``ModuleList``'s children one by one, and a child holding a
    ``ModuleList`` by the same rule."""
    from torch import nn

    if any(True for _ in tower.parameters(recurse=False)) and \
            not any(isinstance(module, nn.ModuleList) for module in tower.modules()):
        return [tower]
    units = []
    for child in tower.children():
        if isinstance(child, nn.ModuleList):
            units += [block for block in child.children() if any(True for _ in block.parameters())]
        elif any(isinstance(module, nn.ModuleList) for module in child.modules()):
            units += _tower_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


# --- memory --------------------------------------------------------------------------------------

def tower_saved_per_patch_layer(v, e):
    """Bytes one tower block saves for backward per patch, as ``memory`` counts a
    Hugging Face layer's per token, for a dense non-causal transformer block
    (flash/SDPA attention, no dropout), ``h`` wide, ``a`` heads, MLP of ``F``::

        LayerNorm x2    2 * (e*h + 8)   the input, fp32 mean and 1/std
        qkv + MLP in    2 * e*h         the norms' outputs, saved by the projections
        attention       4 * e*h + 4*a   q, k, v (rotated), the output (proj's input), fp32 lse
        MLP             2 * e*F         fc1's output and act's (fc2's input); gated: 4 * e*F
    """
    h, F = v.hidden_size, v.intermediate_size
    return 2 * (e * h + 2 * FLOAT32) + 2 * e * h + 4 * e * h + FLOAT32 * v.num_heads + \
        (4 if v.mlp_gated else 2) * e * F


def tower_merger_saved_per_patch(v, e):
    """Bytes the mergers save per patch: Qwen's merger (and each deepstack one) keeps its
    norm's input, fc1's input, act's input and fc2's input, ``4 e h`` a patch (its
    ``patches_per_token`` patches' rows concatenated into a token); taken for every
    family's projector (LLaVA's and Gemma 3's keep less)."""
    return v.features * 4 * e * v.hidden_size


class TowerMemory(NamedTuple):
    """The tower's part of one device's memory, bytes."""

    states: dict  # {"weights", "grads", "optimizer"}
    host: float  # its offloaded optimizer's host bytes (this rank's)
    activations: float  # kept from the tower's forward until its backward, which runs last
    backward: float  # the tower's backward at its peak: one block's tensors and gradients, the unit gathered


def tower_memory(setting, held_params, zero_group, patches, saved_weights=0, gathered=False):
    """``TowerMemory`` of a device that holds ``held_params`` of the tower (its states partitioned by ZeRO
    over ``zero_group``) and encodes ``patches`` patches; ``saved_weights``: gathered weights autograd keeps
    (TSP's units, bytes); ``gathered``: the largest unit is gathered whole in backward, with its gradient
    (TSP's units, ZeRO-3). With activation checkpointing the tower keeps each block's input and runs one
    block again at a time in backward (Hugging Face's checkpointing of its blocks, on the device)."""
    v, p, e = setting.vision, setting.precision, setting.precision.element
    states, host = model_states(held_params, p, setting.zero_stage, zero_group, setting.offload_optimizer,
                                layer_params=v.largest_unit / (zero_group if gathered else 1))
    block = patches * tower_saved_per_patch_layer(v, e)
    kept_per_layer = patches * e * v.hidden_size if setting.activation_checkpointing else block
    activations = v.layers * kept_per_layer + patches * tower_merger_saved_per_patch(v, e) + saved_weights
    grads = patches * e * (2 * v.hidden_size + (3 if v.mlp_gated else 2) * v.intermediate_size)
    backward = (block if setting.activation_checkpointing else 0) + grads + \
        (2 * v.largest_unit * e if gathered else 0)
    return TowerMemory(states, host, activations, backward)


def add_tower(memory, terms, tower):
    """``(memory parts, terms)`` of a plan with ``tower`` added: its states and its kept activations
    through the decoder's phases; the peak is the larger of those and the tower's own backward, which
    runs last, once the decoder's activations are freed (all gradients made)."""
    states = {name: memory[name] + tower.states[name] for name in tower.states}
    decoder_phase = sum(memory.values()) + sum(tower.states.values()) + tower.activations
    tower_phase = sum(states.values()) + tower.activations + tower.backward
    if decoder_phase >= tower_phase:
        return ({**memory, **states, "activations": memory["activations"] + tower.activations},
                {**terms, TOWER_STATES: sum(tower.states.values()), TOWER_ACTIVATIONS: tower.activations})
    decoder_states = sum(memory[name] for name in tower.states)
    return ({**states, "activations": tower.activations, "logits": 0, "transient": tower.backward},
            {STATES: decoder_states, TOWER_STATES: sum(tower.states.values()),
             TOWER_ACTIVATIONS: tower.activations, TOWER_BACKWARD: tower.backward})


def tower_summary(tower, patches, held_params, parts, flops):
    """What ``StrategyPlan.tower`` holds: the device's patches and parameters of the tower, its memory
    (bytes) and its bytes received and FLOPs per step (``parts``: its ``CommPart``s)."""
    return {"patches": patches, "params_held": held_params, "states": sum(tower.states.values()),
            "activations": tower.activations, "backward": tower.backward,
            "comm_per_step": sum(part.nbytes for part in parts.values()), "flops_per_step": flops}


# --- FLOPs and bytes -----------------------------------------------------------------------------

def tower_flops(setting, patches):
    """``(FLOPs, attention FLOPs)`` of encoding ``patches`` patches, forward and backward (and the blocks'
    forward again under checkpointing): per patch and block ``2 (4 h^2 + 2 h F)`` (``3 h F`` gated) in the
    projections and ``4 P h`` in attention over the ``P`` patches of its frame (``setting.frame_tokens``
    tokens); per patch ``2 features (ppt h^2 + h H)`` in the mergers; backward twice the forward."""
    v = setting.vision
    h, F, ppt = v.hidden_size, v.intermediate_size, v.patches_per_token
    block = 2 * (4 * h * h + (3 if v.mlp_gated else 2) * h * F)
    attention = 4 * setting.frame_tokens * ppt * h
    merger = 2 * v.features * (ppt * h * h + h * v.text_hidden_size)
    blocks_passes = 4 if setting.activation_checkpointing else 3
    attention_flops = patches * v.layers * attention * blocks_passes
    return patches * (v.layers * block * blocks_passes + 3 * merger) + attention_flops, attention_flops


def tsp_visual_bytes_by_op(unit_numels, hidden_size, visual_rows, tsp_size, elem_bytes, *, features=1,
                           rows_exchanged=None, trained_numels=None, recomputed_numels=()):
    """Bytes one rank receives for the vision tower in one training step, per
    ``comm`` op name: ``unit_numels`` the tower's units' parameter counts,
    ``visual_rows`` the micro-batch's placeholder tokens (none: no tower runs).
    ``trained_numels``: the units backward reaches (by default all; LLaVA's
    last tower layer and post-norm feed nothing the model reads, so no
    gradient reaches them and none is reduce-scattered). ``recomputed_numels``:
    the units run again in backward (a checkpointed tower's blocks), whose
    gather runs again with them."""
    D, e = tsp_size, elem_bytes
    if D == 1 or not visual_rows:
        return {}
    if rows_exchanged is None:
        expected = Fraction((D - 1) * visual_rows, D * D)
        rows_exchanged = (expected, expected)
    trained_numels = unit_numels if trained_numels is None else trained_numels
    row = features * hidden_size * e
    return {"all_gather": (D - 1) * sum(math.ceil(numel / D) for numel in (*unit_numels, *recomputed_numels)) * e,
            "reduce_scatter": (D - 1) * sum(math.ceil(numel / D) for numel in trained_numels) * e,
            "all_to_all": (rows_exchanged[0] + rows_exchanged[1]) * row}
