"""The TSP forward of a vision-language model (``*ForConditionalGeneration``), DESIGN.md 6m.

Its text decoder becomes TSP blocks as a causal LM's does (the policy is found
at the model's ``get_decoder()``); its images and videos are encoded by the
model's own vision tower, each rank a share of them, and their rows sent to
the ranks that own their placeholder tokens (``ds_tsp.blocks.visual``). The
tower's weights are held 1/D per rank (``ds_tsp.blocks.tower``).

Built for four families (``FAMILIES``): Qwen's (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3.5: patches flattened in ``pixel_values`` with a ``(t, h, w)``
grid per item, merged ``spatial_merge_size**2`` to a placeholder token, and
3-D M-RoPE positions, which the model's own ``get_rope_index`` computes once
from the whole rows, each rank then taking its chunks' columns), LLaVA's
(whole images of one size, plain positions), Gemma 3's (LLaVA's layout, and
one image's tokens attending to each other both ways) and Mistral 3's
(Pixtral: images of their own sizes, plain positions). Other towers are
refused by name.
"""

import inspect

import torch

from ds_tsp.blocks.documents import bidirectional_spans
from ds_tsp.blocks.rotary import text_and_rotary_positions
from ds_tsp.blocks.visual import VisualItem, VisualRoute
from ds_tsp.injection.model import TSPCausalLMMixin
from ds_tsp.parallel.host_reads import host_copy

# The forward inputs the processors of the families built produce besides input_ids and attention_mask.
VISUAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
                 "second_per_grid_ts", "image_sizes", "token_type_ids")


class VisualInputs:
    """One micro-batch's images (and videos) as the model's processor gives
    them, and what the TSP forward does with them: the tower's share on this
    rank, its rows to their tokens' ranks. A family says how its items are
    counted, encoded and positioned (``positions``, ``items``, ``encode``)."""

    # The visual inputs the family's forward takes (its processor's).
    TAKES = VISUAL_INPUTS

    def __init__(self, model, inputs):
        given = sorted(name for name, value in inputs.items() if value is not None and name not in self.TAKES)
        if given:
            raise ValueError(f"{type(model).__name__} takes {list(self.TAKES)} of the visual inputs, not {given}: "
                             "pass what its processor returns")
        self.model, self.inputs = model, inputs
        # After ``embed``: the route and, per decoder layer the tower also feeds (Qwen3-VL's deepstack), the
        # rows added to its output at this rank's placeholders.
        self.route, self.deepstack = None, []
        # Host copies of inputs already read (``positions``), for what reads them again.
        self.host_inputs = {}

    def positions(self, input_ids, attention_mask, position_ids):
        """``(text positions or None, rotary positions (3, B, S) or None)``: the position ids as given."""
        return position_ids, None

    def spans(self, left_padding):
        """Per row, the runs of tokens that attend to each other both ways
        (``documents.bidirectional_spans``, moved left by each row's
        ``left_padding`` ``(B,)``, or None), or None: every family's tokens
        attend causally but Gemma 3's images."""
        return None

    def embed(self, hidden, token_ids, topology, layout_name):
        """``hidden`` (this rank's embeddings ``(B, S/D, H)`` of the host ids
        ``token_ids`` ``(B, S)``, padded as TSP pads them) with the visual
        rows in place: this rank encodes its share of the items and sends each
        row to its placeholder's rank. A rank whose share is empty encodes the
        smallest item and sends none of it, so that every rank's tower runs
        the same graph (its gathers and gradient sums over the group line up)
        and its gradient there is zero."""
        items = self.items(token_ids)
        route = VisualRoute(items, token_ids, topology.tsp_rank, topology.tsp_size, layout_name)
        mine = list(route.items) or [min(range(len(items)), key=lambda i: items[i].patches)]
        # The merged rows and, side by side, the features the tower adds after the first decoder layers: one
        # all-to-all carries them all.
        encoded = torch.cat([torch.cat(feature) for feature in self.encode(items, mine)], dim=-1)
        if not len(route.items):
            encoded = encoded[:0]
        rows = route.received(encoded, topology.tsp_group).split(hidden.shape[-1], dim=-1)
        self.route, self.deepstack = route, rows[1:]
        return route.place(hidden, rows[0])

    def after_layer(self, index, hidden):
        """Decoder layer ``index``'s output, with the tower's features for it added at the visual tokens
        (Qwen3-VL's deepstack feeds its first layers; other towers none)."""
        return self.route.add(hidden, self.deepstack[index]) if index < len(self.deepstack) else hidden


class QwenVisualInputs(VisualInputs):
    """Qwen's images and videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5):
    patches flattened in ``pixel_values`` with a ``(t, h, w)`` grid per item,
    ``spatial_merge_size**2`` patches to a placeholder token, M-RoPE positions."""

    TAKES = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
             "second_per_grid_ts")

    def positions(self, input_ids, attention_mask, position_ids):
        """``(text positions or None, rotary positions (3, B, S) or None)``:
        position ids passed in as Hugging Face reads them
        (``rotary.text_and_rotary_positions``); without them the model's
        ``get_rope_index`` computes them from the whole rows, on one host copy
        of what it reads, the grids included (``items`` reads them from it)."""
        if position_ids is not None:
            return text_and_rotary_positions(position_ids)
        inner = self.model.model
        wanted = inspect.signature(inner.get_rope_index).parameters
        names = [name for name in ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                 if name in wanted and self.inputs.get(name) is not None]
        if self.inputs.get("mm_token_type_ids") is None:
            raise ValueError("images or videos were given without mm_token_type_ids, which M-RoPE positions are "
                             "computed from: pass the processor's mm_token_type_ids (as Hugging Face's forward asks)")
        host = host_copy(input_ids, attention_mask, *(self.inputs[name] for name in names), reason="visual positions")
        self.host_inputs = dict(zip(names, host[2:]))
        rotary, _ = inner.get_rope_index(host[0], attention_mask=host[1], **self.host_inputs)
        return None, rotary.to(input_ids.device)

    def _kinds(self):
        """``(placeholder id, pixels, grids, the grids' name)`` of the images, then the videos, where given."""
        config = self.model.config
        kinds = [(token_id, self.inputs.get(pixels), self.inputs.get(grids), grids)
                 for token_id, pixels, grids in ((config.image_token_id, "pixel_values", "image_grid_thw"),
                                                 (config.video_token_id, "pixel_values_videos", "video_grid_thw"))]
        return [kind for kind in kinds if kind[1] is not None]

    def _pieces(self):
        """The items as the tower encodes them, in the order their rows fill the placeholders (images, then
        videos): ``(placeholder id, pixels, first pixel row, (h, w))``, each temporal patch of an item its own
        piece. Qwen's towers attend within a temporal patch (Qwen2.5-VL's windows lie in one too), so a long
        video's temporal patches are encoded apart, on the ranks that share them. The grids from
        ``positions``' host copy, else one host read of them."""
        kinds = self._kinds()
        if all(name in self.host_inputs for *_, name in kinds):
            host_grids = [self.host_inputs[name] for *_, name in kinds]
        else:
            host_grids = host_copy(*(grids for _, _, grids, _ in kinds), reason="visual grids")
        pieces = []
        for (token_id, pixels, *_), grids in zip(kinds, host_grids):
            row = 0
            for t, h, w in grids.tolist():
                pieces += [(token_id, pixels, row + frame * h * w, (h, w)) for frame in range(t)]
                row += t * h * w
        return pieces

    def items(self, token_ids):
        merge = self.model.model.visual.spatial_merge_size
        self.pieces = self._pieces()
        return [VisualItem(token_id, h * w, h * w // merge ** 2) for token_id, _, _, (h, w) in self.pieces]

    def encode(self, items, mine):
        """The tower's features of items ``mine`` (a contiguous run), images and videos together in one call
        (Qwen's get_video_features is its image path): per kind of feature, one tensor a item."""
        chosen = [self.pieces[index] for index in mine]
        pixels = torch.cat([tensor[row:row + h * w] for _, tensor, row, (h, w) in chosen])
        grids = torch.tensor([[1, h, w] for *_, (h, w) in chosen], device=pixels.device)
        output = self.model.get_image_features(pixels, grids, return_dict=True)
        return [output.pooler_output, *(getattr(output, "deepstack_features", None) or ())]


class LlavaVisualInputs(VisualInputs):
    """LLaVA's images: ``pixel_values`` ``(N, C, H, W)``, each image encoded to
    the same number of placeholder tokens (the tower's patches, its
    ``vision_feature_layer`` and ``vision_feature_select_strategy``), plain positions."""

    TAKES = ("pixel_values",)

    def items(self, token_ids):
        image_token_id, count = self.model.config.image_token_id, self.inputs["pixel_values"].shape[0]
        tokens = int((token_ids == image_token_id).sum())
        if tokens % count:
            raise ValueError(f"the batch holds {tokens} image tokens (id {image_token_id}) for {count} images, "
                             "which cannot each take the same number: build the inputs with the model's processor, "
                             "and truncate no row inside an image")
        return [VisualItem(image_token_id, 1, tokens // count)] * count

    def encode(self, items, mine):
        pixels = self.inputs["pixel_values"][mine[0]:mine[-1] + 1]
        return [self.model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output]


class GemmaVisualInputs(LlavaVisualInputs):
    """Gemma 3's images: LLaVA's layout (``pixel_values`` ``(N, C, H, W)`` of
    one size, ``mm_tokens_per_image`` placeholders each: SigLIP, pooled and
    projected), and, where ``token_type_ids`` are given (its processor's: 1 on
    the image tokens), one image's tokens attending to each other both ways,
    as Hugging Face's mask lets them (``spans``)."""

    TAKES = ("pixel_values", "token_type_ids")

    def encode(self, items, mine):
        """LLaVA's, its projector's output ``(N, tokens, H)`` one tensor an image."""
        return [super().encode(items, mine)[0].unbind()]

    def spans(self, left_padding):
        types = self.inputs.get("token_type_ids")
        if types is None:  # Hugging Face's mask is then causal everywhere
            return None
        return bidirectional_spans(*host_copy(types == 1, left_padding, reason="image spans"))


class PixtralVisualInputs(VisualInputs):
    """Mistral 3's images: ``pixel_values`` ``(N, C, H, W)`` padded to the
    largest, each image's own ``image_sizes`` ``(h, w)`` in pixels; Pixtral
    attends within each image, the projector merges ``spatial_merge_size**2``
    patches to a placeholder token; plain positions."""

    TAKES = ("pixel_values", "image_sizes")

    def items(self, token_ids):
        image_token_id, config = self.model.config.image_token_id, self.model.config
        patch = self.model.model.vision_tower.patch_size
        sizes = host_copy(self.inputs["image_sizes"], reason="visual grids")[0]
        return [VisualItem(image_token_id, int(h // patch) * int(w // patch),
                           int(h // (patch * config.spatial_merge_size)) * int(w // (patch * config.spatial_merge_size)))
                for h, w in sizes]

    def encode(self, items, mine):
        chosen = slice(mine[0], mine[-1] + 1)
        return [self.model.model.get_image_features(pixel_values=self.inputs["pixel_values"][chosen],
                                                    image_sizes=self.inputs["image_sizes"][chosen],
                                                    return_dict=True).pooler_output]


# The TSP forward's visual inputs by vision-language family (``ds_tsp.injection.policy.vision_family``).
FAMILIES = {"qwen": QwenVisualInputs, "llava": LlavaVisualInputs, "gemma3": GemmaVisualInputs,
            "mistral3": PixtralVisualInputs}


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
            _check_text_only(inputs)
            return None
        return FAMILIES[self.tsp_vision_family](self, inputs)


def _check_text_only(inputs):
    """A batch without pixels may carry its processor's token types, but none
    may mark image tokens: Hugging Face would still let them see each other
    (Gemma 3's mask), with no image in their place."""
    types = inputs.pop("token_type_ids")
    if types is not None and host_copy((types != 0).any(), reason="token types")[0]:
        raise ValueError("token_type_ids mark image tokens but no pixel_values were given: pass the images the "
                         "processor made those tokens for, or token_type_ids of zeros (text only)")
