"""Tiny Hugging Face vision-language models built in code, and batches as their processors lay them out."""

import sys

import torch
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, LlavaConfig, LlavaForConditionalGeneration,
                          Mistral3Config, Mistral3ForConditionalGeneration, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                          Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

from models import tiny_config, widen_float32_casts

# Placeholder and delimiter ids at the top of the tiny vocabulary (the processor's special tokens).
VOCAB, IMAGE, VIDEO, VISION_START, VISION_END = 64, 60, 61, 62, 63
TEXT, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2  # mm_token_type_ids
# Qwen's patches: 3 channels, 2 frames a temporal patch, 2 x 2 pixels; 2 x 2 patches merge into a token.
CHANNELS, TEMPORAL_PATCH, PATCH, MERGE = 3, 2, 2, 2
TEXT_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
SPECIAL = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)


# Qwen2.5-VL's tower: windows of 2 x 2 merged tokens (window_size in pixels) in its first block, whole items in
# its last (fullatt_block_indexes). Qwen3-VL's and Qwen3.5's: learned positions on a 4 x 4 grid, interpolated to
# each item's; Qwen3-VL's deepstack adds features of both tower blocks to both decoder layers' outputs.
VISION_CONFIGS = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                 dict(depth=2, embed_dim=16, num_heads=2, mlp_ratio=2, hidden_size=TEXT_CONFIG["hidden_size"])),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                   dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, window_size=8,
                        fullatt_block_indexes=[1], out_hidden_size=TEXT_CONFIG["hidden_size"])),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                 dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, num_position_embeddings=16,
                      out_hidden_size=TEXT_CONFIG["hidden_size"], deepstack_visual_indexes=[0, 1])),
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                    dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, num_position_embeddings=16,
                         out_hidden_size=TEXT_CONFIG["hidden_size"])),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration,
                dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, num_position_embeddings=16,
                     out_hidden_size=TEXT_CONFIG["hidden_size"])),
}


# LLaVA 1.5's shape: a CLIP tower over 8 x 8 images of 4 x 4 patches (4 tokens an image, the CLS dropped), the
# second-to-last layer's features (its last layer then takes no gradient, as in Hugging Face), a Llama decoder.
LLAVA_VISION = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=2, image_size=8, patch_size=4)
LLAVA_IMAGE_TOKENS, LLAVA_IMAGE = 4, (CHANNELS, 8, 8)


# Gemma 3's shape: a SigLIP tower over 8 x 8 images of 2 x 2 patches, pooled to 16 tokens an image (longer than the
# decoder's sliding window of 5, so an image's tokens see each other beyond it), each between delimiters; a
# Gemma 3 decoder (a sliding layer, then a full one).
GEMMA_VISION = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, image_size=8, patch_size=2, vision_use_head=False)
GEMMA_IMAGE_TOKENS, GEMMA_IMAGE = 16, (CHANNELS, 8, 8)


# Mistral 3's shape: a Pixtral tower of 2 x 2 pixel patches (the tests' grids, in patches, times 2 in pixels), its
# projector merging 2 x 2 patches to a token, a Mistral decoder.
PIXTRAL_VISION = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, head_dim=8, image_size=16, patch_size=PATCH)


def tiny_vlm(arch="qwen2_vl", seed=0, dtype=torch.float64):
    """The vision-language model ``arch`` on a tiny config. Its rotary dims (head_dim 8; Qwen3.5: half of 16)
    hold four frequencies, which M-RoPE splits 2 (time), 1 (height), 1 (width); a small rope_theta keeps the
    height's and width's frequencies (0.1, 0.03) large enough that their positions matter. Qwen3.5's text
    decoder is the hybrid's tiny one (three Gated DeltaNet layers, then a gated attention layer, whose positions
    are the M-RoPE ones), its Hugging
    Face float32 casts widened to float64 as for the text model (``models.widen_float32_casts``)."""
    torch.manual_seed(seed)
    if arch == "gemma3":
        text = tiny_config("gemma3", **TEXT_CONFIG, head_dim=8, final_logit_softcapping=None).to_dict()
        config = Gemma3Config(text_config=text, vision_config=GEMMA_VISION, image_token_id=IMAGE,
                              boi_token_id=VISION_START, eoi_token_id=VISION_END,
                              mm_tokens_per_image=GEMMA_IMAGE_TOKENS)
        config.text_config._attn_implementation = "sdpa"
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # Hugging Face starts the projection at zeros: no image would matter
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
        return model.to(dtype).eval()
    if arch == "mistral3":
        config = Mistral3Config(text_config={"model_type": "mistral", **TEXT_CONFIG, "head_dim": 8},
                                vision_config=PIXTRAL_VISION, image_token_id=IMAGE, spatial_merge_size=MERGE)
        config.text_config._attn_implementation = "sdpa"
        return Mistral3ForConditionalGeneration(config).to(dtype).eval()
    if arch == "llava":
        config = LlavaConfig(text_config={"model_type": "llama", **TEXT_CONFIG, "head_dim": 8},
                             vision_config=LLAVA_VISION, image_token_id=IMAGE)
        config.text_config._attn_implementation = "sdpa"
        return LlavaForConditionalGeneration(config).to(dtype).eval()
    config_class, model_class, vision = VISION_CONFIGS[arch]
    rope = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1]}
    text = {**TEXT_CONFIG, "rope_parameters": rope}
    if arch == "qwen3_vl":
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text = {**tiny_config(arch, **{**TEXT_CONFIG, "num_hidden_layers": 4}).to_dict(), "head_dim": 16,
                "rope_parameters": {**rope, "partial_rotary_factor": 0.5, "mrope_interleaved": True}}
    vision = {**vision, "patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "spatial_merge_size": MERGE,
              "in_channels": CHANNELS}
    config = config_class(text_config=text, vision_config=vision, **SPECIAL)
    config.text_config._attn_implementation = "sdpa"
    config.text_config._experts_implementation = "eager"  # HF's grouped_mm takes no float64
    model = model_class(config)
    widen_float32_casts(sys.modules[type(model).__module__])
    return model.to(dtype).eval()


def visual_batch(rows, seed=0, dtype=torch.float64, frames_apart=False, llava=False, pixtral=False, gemma=False):
    """Processor-style inputs for ``rows``: each a list of ``("text", n)``,
    ``("image", (t, h, w))`` or ``("video", (t, h, w))`` (grids in patches)
    and ``("pad", n)`` at the end; rows shorter than the longest are padded
    at the end. ``frames_apart``: each temporal patch of a video is its own
    run of placeholders after a timestamp token, as Qwen3-VL's and Qwen3.5's
    processors write videos. ``llava``: LLaVA's layout instead (every image
    ``LLAVA_IMAGE_TOKENS`` placeholders, no delimiters or grids, its pixels
    ``(N, 3, 8, 8)``, no ``mm_token_type_ids``). Returns the forward's keyword
    arguments, labels -100 on the visual tokens, their delimiters and the padding.
    ``pixtral``: Mistral 3's (each image its grid's placeholders, no
    delimiters; pixels ``(N, 3, H, W)`` padded to the largest, ``image_sizes``).
    ``gemma``: Gemma 3's (every image ``GEMMA_IMAGE_TOKENS`` placeholders
    between delimiters, pixels ``(N, 3, 8, 8)``, ``token_type_ids`` 1 on the
    placeholders)."""
    generator = torch.Generator().manual_seed(seed)
    ids, types, labels, masks, grids = [], [], [], [], {"image": [], "video": []}
    for row in rows:
        row_ids, row_types, row_mask = [], [], []
        for kind, size in row:
            if kind in ("text", "pad"):
                row_ids += torch.randint(0, VISION_START - 4, (size,), generator=generator).tolist()
                row_types += [TEXT] * size
                row_mask += [int(kind == "text")] * size
                continue
            if gemma:
                row_ids += [VISION_START] + [IMAGE] * GEMMA_IMAGE_TOKENS + [VISION_END]
                row_types += [TEXT] + [IMAGE_TYPE] * GEMMA_IMAGE_TOKENS + [TEXT]
                row_mask += [1] * (GEMMA_IMAGE_TOKENS + 2)
                grids[kind].append(size)
                continue
            if llava:
                row_ids += [IMAGE] * LLAVA_IMAGE_TOKENS
                row_types += [IMAGE_TYPE] * LLAVA_IMAGE_TOKENS
                row_mask += [1] * LLAVA_IMAGE_TOKENS
                grids[kind].append(size)
                continue
            t, h, w = size
            if pixtral:
                tokens = h * w // MERGE ** 2
                row_ids += [IMAGE] * tokens
                row_types += [IMAGE_TYPE] * tokens
                row_mask += [1] * tokens
                grids[kind].append(size)
                continue
            placeholder, kind_type = (IMAGE, IMAGE_TYPE) if kind == "image" else (VIDEO, VIDEO_TYPE)
            runs = t if kind == "video" and frames_apart else 1
            for _ in range(runs):
                tokens = t * h * w // MERGE ** 2 // runs
                timestamp = [1] if runs > 1 else []  # a text token: "<t seconds>"
                row_ids += timestamp + [VISION_START] + [placeholder] * tokens + [VISION_END]
                row_types += [TEXT] * len(timestamp) + [TEXT] + [kind_type] * tokens + [TEXT]
                row_mask += [1] * (len(timestamp) + tokens + 2)
            grids[kind].append(size)
        ids.append(row_ids), types.append(row_types), masks.append(row_mask)
    width = max(len(row) for row in ids)
    for row_ids, row_types, row_mask in zip(ids, types, masks):
        row_ids += [0] * (width - len(row_ids))
        row_types += [TEXT] * (width - len(row_types))
        row_mask += [0] * (width - len(row_mask))
    input_ids, mask = torch.tensor(ids), torch.tensor(masks)
    labels = input_ids.masked_fill((input_ids >= VISION_START - 4) | (mask == 0), -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
             "mm_token_type_ids": torch.tensor(types)}
    if pixtral:
        del batch["mm_token_type_ids"]
        sizes = torch.tensor([(h * PATCH, w * PATCH) for _, h, w in grids["image"]])
        batch["image_sizes"] = sizes
        batch["pixel_values"] = torch.randn(len(sizes), CHANNELS, *sizes.amax(dim=0).tolist(), generator=generator,
                                            dtype=dtype)
        return batch
    if gemma:
        batch["token_type_ids"] = batch.pop("mm_token_type_ids")
        batch["pixel_values"] = torch.randn(len(grids["image"]), *GEMMA_IMAGE, generator=generator, dtype=dtype)
        return batch
    if llava:
        del batch["mm_token_type_ids"]
        batch["pixel_values"] = torch.randn(len(grids["image"]), *LLAVA_IMAGE, generator=generator, dtype=dtype)
        return batch
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):
        if grids[kind]:
            batch[grid] = torch.tensor(grids[kind])
            patches = int(batch[grid].prod(dim=-1).sum())
            batch[pixels] = torch.randn(patches, CHANNELS * TEMPORAL_PATCH * PATCH * PATCH, generator=generator,
                                        dtype=dtype)
    return batch


def packed_visual_batch(model, rows, frames_apart=False):
    """Rows of packed documents (``rows``: per row, its documents, each as
    ``visual_batch`` takes a row), as a packing collator writes them for
    Qwen's models: each document's M-RoPE positions from the model's
    ``get_rope_index`` on it alone, behind its text positions (from 0), in
    position ids of shape ``(4, B, S)``; the images and videos in row order."""
    documents = packed_documents(model, rows, frames_apart)
    if model.config.model_type in PLAIN_LAYOUTS:
        return _packed_plain_batch(documents, model.config.model_type)
    batch = {key: torch.stack([torch.cat([doc[key][0] for doc in row]) for row in documents])
             for key in ("input_ids", "labels", "mm_token_type_ids")}
    positions = []
    for row in documents:
        pieces = []
        for doc in row:
            grids = {key: doc[key] for key in ("image_grid_thw", "video_grid_thw") if key in doc}
            rotary, _ = model.model.get_rope_index(doc["input_ids"], mm_token_type_ids=doc["mm_token_type_ids"],
                                                   **grids)
            text = torch.arange(doc["input_ids"].shape[1]).view(1, 1, -1)
            pieces.append(torch.cat([text, rotary]))
        positions.append(torch.cat(pieces, dim=-1))
    batch["position_ids"] = torch.cat(positions, dim=1)
    for pixels, grids in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        held = [doc for row in documents for doc in row if grids in doc]
        if held:
            batch[pixels] = torch.cat([doc[pixels] for doc in held])
            batch[grids] = torch.cat([doc[grids] for doc in held])
    return batch


def _same_length(documents):
    """Packed rows (lists of ``visual_batch`` documents) of one length: a text document fills a shorter one."""
    lengths = [sum(doc["input_ids"].shape[1] for doc in row) for row in documents]
    for row, length in zip(documents, lengths):
        if length < max(lengths):
            row.append(visual_batch([[("text", max(lengths) - length)]], seed=len(row)))
    return documents


# The families with plain positions, by model type: ``visual_batch``'s layout for each.
PLAIN_LAYOUTS = {"llava": {"llava": True}, "gemma3": {"gemma": True}, "mistral3": {"pixtral": True}}


def packed_documents(model, rows, frames_apart=False):
    """The documents of packed ``rows`` (``packed_visual_batch``'s), each its own ``visual_batch`` in the
    family's layout (a text-only document of a family with plain positions in LLaVA's, which has no grids),
    the rows filled to one length by a text document."""
    plain = PLAIN_LAYOUTS.get(model.config.model_type)
    return _same_length([[visual_batch([document], seed=index, **(
        {"frames_apart": frames_apart} if plain is None else
        plain if any(kind == "image" for kind, _ in document) else {"llava": True}))
        for index, document in enumerate(row)] for row in rows])


def _packed_plain_batch(documents, model_type):
    """``packed_visual_batch`` for the families with plain positions (LLaVA, Gemma 3, Mistral 3): position
    ids from 0 in each document, no attention mask, the images in row order (Mistral 3's pixels padded to
    the largest, with their ``image_sizes``; Gemma 3's ``token_type_ids`` over the row)."""
    keys = ("input_ids", "labels", "token_type_ids") if model_type == "gemma3" else ("input_ids", "labels")
    batch = {key: torch.stack([torch.cat([doc.get(key, torch.zeros_like(doc["input_ids"]))[0] for doc in row])
                               for row in documents]) for key in keys}
    batch["position_ids"] = torch.stack([torch.cat([torch.arange(doc["input_ids"].shape[1]) for doc in row])
                                         for row in documents])
    pixels = [doc["pixel_values"] for row in documents for doc in row if len(doc.get("pixel_values", ()))]
    height, width = max(p.shape[2] for p in pixels), max(p.shape[3] for p in pixels)
    batch["pixel_values"] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[3], 0, height - p.shape[2]))
                                       for p in pixels])
    if model_type == "mistral3":
        batch["image_sizes"] = torch.cat([doc["image_sizes"] for row in documents for doc in row
                                          if "image_sizes" in doc])
    return batch
