"""Tiny Hugging Face vision-language models built in code, and batches as their processors lay them out."""

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

# Placeholder and delimiter ids at the top of the tiny vocabulary (the processor's special tokens).
VOCAB, IMAGE, VIDEO, VISION_START, VISION_END = 64, 60, 61, 62, 63
TEXT, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2  # mm_token_type_ids
# Qwen's patches: 3 channels, 2 frames a temporal patch, 2 x 2 pixels; 2 x 2 patches merge into a token.
CHANNELS, TEMPORAL_PATCH, PATCH, MERGE = 3, 2, 2, 2
TEXT_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
VISION_CONFIG = dict(depth=2, embed_dim=16, num_heads=2, mlp_ratio=2, patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH,
                     spatial_merge_size=MERGE, in_channels=CHANNELS)
SPECIAL = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)


def tiny_vlm(arch="qwen2_vl", seed=0, dtype=torch.float64):
    """The vision-language model ``arch`` on a tiny config: head_dim 8, whose four rotary frequencies M-RoPE
    splits 2 (time), 1 (height), 1 (width); a small rope_theta keeps the height's and width's frequencies
    (0.1, 0.03) large enough that their positions matter."""
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1]}
    config = Qwen2VLConfig(text_config={**TEXT_CONFIG, "rope_parameters": rope},
                           vision_config={**VISION_CONFIG, "hidden_size": TEXT_CONFIG["hidden_size"]}, **SPECIAL)
    config.text_config._attn_implementation = "sdpa"
    return Qwen2VLForConditionalGeneration(config).to(dtype).eval()


def visual_batch(rows, seed=0, dtype=torch.float64):
    """Processor-style inputs for ``rows``: each a list of ``("text", n)``,
    ``("image", (t, h, w))`` or ``("video", (t, h, w))`` (grids in patches)
    and ``("pad", n)`` at the end. Returns the forward's keyword arguments,
    labels -100 on the visual tokens, their delimiters and the padding."""
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
            t, h, w = size
            tokens = t * h * w // MERGE ** 2
            placeholder, kind_type = (IMAGE, IMAGE_TYPE) if kind == "image" else (VIDEO, VIDEO_TYPE)
            row_ids += [VISION_START] + [placeholder] * tokens + [VISION_END]
            row_types += [TEXT] + [kind_type] * tokens + [TEXT]
            row_mask += [1] * (tokens + 2)
            grids[kind].append(size)
        ids.append(row_ids), types.append(row_types), masks.append(row_mask)
    width = max(len(row) for row in ids)
    if any(len(row) != width for row in ids):
        raise ValueError(f"rows of lengths {[len(row) for row in ids]}: pad them to one length with (\"pad\", n)")
    input_ids, mask = torch.tensor(ids), torch.tensor(masks)
    labels = input_ids.masked_fill((input_ids >= VISION_START - 4) | (mask == 0), -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
             "mm_token_type_ids": torch.tensor(types)}
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):
        if grids[kind]:
            batch[grid] = torch.tensor(grids[kind])
            patches = int(batch[grid].prod(dim=-1).sum())
            batch[pixels] = torch.randn(patches, CHANNELS * TEMPORAL_PATCH * PATCH * PATCH, generator=generator,
                                        dtype=dtype)
    return batch
