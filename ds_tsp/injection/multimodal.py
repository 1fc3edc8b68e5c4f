"""The TSP forward of a vision-language model (``*ForConditionalGeneration``), DESIGN.md 6m.

Its text decoder becomes TSP blocks as a causal LM's does (the policy is found
at the model's ``get_decoder()``); its images and videos are encoded by the
model's own vision tower, each rank a share of them, and their rows sent to
the ranks that own their placeholder tokens (``ds_tsp.blocks.visual``). The
tower's weights stay whole on every rank (replicated: their gradients sum
over the TSP group like a norm's).

Built for towers of Qwen's form (Qwen2-VL, Qwen2.5-VL, Qwen3.5): patches
flattened in ``pixel_values`` with a ``(t, h, w)`` grid per item, merged
``spatial_merge_size**2`` to a placeholder token, and 3-D M-RoPE positions,
which the model's own ``get_rope_index`` computes once from the whole rows
(each rank then takes its chunks' columns). Other towers are refused by name.
"""

import inspect

import torch

from ds_tsp.blocks.visual import VisualItem, VisualRoute
from ds_tsp.injection.model import TSPCausalLMMixin
from ds_tsp.parallel.host_reads import host_copy

# The forward inputs a Qwen-style processor produces besides input_ids and attention_mask.
VISUAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
                 "second_per_grid_ts")


class VisualInputs:
    """One micro-batch's images and videos, as a Qwen-style processor gives
    them, and what the TSP forward does with them: positions from the whole
    rows, the tower's share on this rank, its rows to their tokens' ranks."""

    def __init__(self, model, inputs):
        self.model, self.inputs = model, inputs
        # After ``embed``: the route and, per decoder layer the tower also feeds (Qwen3-VL's deepstack), the
        # rows added to its output at this rank's placeholders.
        self.route, self.deepstack = None, []

    def positions(self, input_ids, attention_mask, position_ids):
        """``(text positions or None, rotary positions (3, B, S) or None)``.
        Position ids passed in keep Hugging Face's meaning: ``(3, B, S)`` are
        the rotary positions, ``(4, B, S)`` text positions (packed documents)
        then those, ``(B, S)`` positions for every axis; without them the
        model's ``get_rope_index`` computes them from the whole rows, on one
        host copy of what it reads."""
        if position_ids is not None:
            if position_ids.dim() == 3 and position_ids.shape[0] == 4:
                return position_ids[0], position_ids[1:]
            if position_ids.dim() == 3:
                return None, position_ids
            return position_ids, None
        inner = self.model.model
        wanted = inspect.signature(inner.get_rope_index).parameters
        names = [name for name in ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                 if name in wanted and self.inputs.get(name) is not None]
        if self.inputs.get("mm_token_type_ids") is None:
            raise ValueError("images or videos were given without mm_token_type_ids, which M-RoPE positions are "
                             "computed from: pass the processor's mm_token_type_ids (as Hugging Face's forward asks)")
        host = host_copy(input_ids, attention_mask, *(self.inputs[name] for name in names), reason="visual positions")
        rotary, _ = inner.get_rope_index(host[0], attention_mask=host[1], **dict(zip(names, host[2:])))
        return None, rotary.to(input_ids.device)

    def items(self):
        """The visual items in the order their rows fill the placeholders (images, then videos), and
        ``(pixels, grids)`` of each kind; one host read of the grids."""
        config, merge = self.model.config, self.model.model.visual.spatial_merge_size
        kinds = [(token_id, self.inputs.get(pixels), self.inputs.get(grids))
                 for token_id, pixels, grids in ((config.image_token_id, "pixel_values", "image_grid_thw"),
                                                 (config.video_token_id, "pixel_values_videos", "video_grid_thw"))]
        kinds = [kind for kind in kinds if kind[1] is not None]
        host_grids = host_copy(*(grids for _, _, grids in kinds), reason="visual grids")
        items = [VisualItem(token_id, int(patches), int(patches) // merge ** 2)
                 for (token_id, _, _), grids in zip(kinds, host_grids) for patches in grids.prod(dim=-1)]
        return items, [(pixels, grids) for _, pixels, grids in kinds]

    def embed(self, hidden, token_ids, topology, layout_name):
        """``hidden`` (this rank's embeddings ``(B, S/D, H)`` of the host ids
        ``token_ids`` ``(B, S)``, padded as TSP pads them) with the visual
        rows in place: this rank encodes its share of the items and sends each
        row to its placeholder's rank. A rank whose share is empty encodes the
        smallest item and sends none of it, so that every rank's tower runs
        the same graph (its gradient sums over the group line up) and its
        gradient there is zero."""
        items, kinds = self.items()
        route = VisualRoute(items, token_ids, topology.tsp_rank, topology.tsp_size, layout_name)
        mine = route.items if len(route.items) else [min(range(len(items)), key=lambda i: items[i].patches)]
        pixels, grids = self._share(items, kinds, mine)
        output = self.model.get_image_features(pixels, grids, return_dict=True)
        # The merged rows and, side by side, the features the tower adds after the first decoder layers: one
        # all-to-all carries them all.
        features = [output.pooler_output, *(getattr(output, "deepstack_features", None) or ())]
        encoded = torch.cat([torch.cat(feature) for feature in features], dim=-1)
        if not len(route.items):
            encoded = encoded[:0]
        rows = route.received(encoded, topology.tsp_group).split(hidden.shape[-1], dim=-1)
        self.route, self.deepstack = route, rows[1:]
        return route.place(hidden, rows[0])

    def after_layer(self, index, hidden):
        """Decoder layer ``index``'s output, with the tower's features for it added at the visual tokens
        (Qwen3-VL's deepstack feeds its first layers; other towers none)."""
        return self.route.add(hidden, self.deepstack[index]) if index < len(self.deepstack) else hidden

    @staticmethod
    def _share(items, kinds, mine):
        """The pixel rows and grids of items ``mine`` (a contiguous run), images and videos together: the
        tower encodes each item alone, whichever kind it is (Qwen's get_video_features is its image path)."""
        pixels, grids, first_item = [], [], 0
        for tensor, grid in kinds:
            count = grid.shape[0]
            wanted = [index - first_item for index in mine if first_item <= index < first_item + count]
            if wanted:
                before = sum(items[first_item + i].patches for i in range(wanted[0]))
                length = sum(items[first_item + i].patches for i in wanted)
                pixels.append(tensor[before:before + length])
                grids.append(grid[wanted[0]:wanted[-1] + 1])
            first_item += count
        return torch.cat(pixels), torch.cat(grids)


class TSPVisionLanguageMixin(TSPCausalLMMixin):
    """Put in front of a Hugging Face vision-language class by ``ds_tsp.inject``:
    the causal LM's TSP forward, taking the processor's visual inputs too."""

    def forward(self, *args, **kwargs):
        """``TSPCausalLMMixin.forward``, its signature naming the processor's
        visual inputs too: Hugging Face's ``generate`` passes a forward the
        arguments its signature names (and refuses the others)."""
        return super().forward(*args, **kwargs)

    forward.__signature__ = inspect.signature(TSPCausalLMMixin.forward).replace(parameters=[
        *(p for p in inspect.signature(TSPCausalLMMixin.forward).parameters.values() if p.kind != p.VAR_KEYWORD),
        *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in VISUAL_INPUTS),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

    def _visual_inputs(self, kwargs):
        inputs = {name: kwargs.pop(name, None) for name in VISUAL_INPUTS}
        if inputs["pixel_values"] is None and inputs["pixel_values_videos"] is None:
            return None
        return VisualInputs(self, inputs)
