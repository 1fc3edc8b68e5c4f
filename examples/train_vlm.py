"""Train a vision-language model with TSP under the deepspeed launcher.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_vlm.py --deepspeed_config ds_configs/tsp2_cpu.json

A small Qwen2-VL-shaped model, built in code (nothing is downloaded), learns
to caption synthetic images: each row is a short prompt, an image whose
patches carry its class, and a caption naming the class; the loss is taken on
the caption only, as a vision collator masks the prompt and the visual tokens.
Each rank of the TSP group encodes its share of the micro-batch's images, holds
1/D of the tower's weights and 1/D of every decoder layer's; the inputs are
what Qwen's processor returns (``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``). Logs the loss and the parameters each rank holds.
"""

import argparse
import json

import torch
import torch.distributed as dist
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

import ds_tsp
from ds_tsp.config import load_ds_config

VOCAB, IMAGE, VISION_START, VISION_END = 64, 60, 62, 63
CLASSES, GRID, MERGE = 4, (1, 4, 4), 2  # an image: 16 patches of 2 frames x 2 x 2 pixels, 4 tokens once merged
PATCH = 3 * 2 * 2 * 2


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON/hjson config with a tsp section")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def tiny_qwen2_vl():
    rope = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1]}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, rope_parameters=rope, bos_token_id=1,
                         eos_token_id=1),
        vision_config=dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, hidden_size=64, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=MERGE),
        image_token_id=IMAGE, video_token_id=61, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return Qwen2VLForConditionalGeneration(config)


def batch(rows, generator):
    """``rows`` captioned images as Qwen's processor lays them out: prompt, image, caption."""
    tokens = GRID[0] * GRID[1] * GRID[2] // MERGE ** 2
    classes = torch.randint(0, CLASSES, (rows,), generator=generator)
    prompt = [5, 6, 7]
    ids = [prompt + [VISION_START] + [IMAGE] * tokens + [VISION_END] + [10 + int(c)] * 3 + [1] for c in classes]
    input_ids = torch.tensor(ids)
    caption = torch.zeros_like(input_ids, dtype=torch.bool)
    caption[:, -4:] = True
    patches = GRID[0] * GRID[1] * GRID[2]
    # Each image's patches carry its class in their mean; the noise makes the tower work for it.
    means = (classes.float() - (CLASSES - 1) / 2).repeat_interleave(patches).unsqueeze(1)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.masked_fill(~caption, -100),
            "mm_token_type_ids": (input_ids == IMAGE).int(),
            "pixel_values": means + 0.5 * torch.randn(rows * patches, PATCH, generator=generator),
            "image_grid_thw": torch.tensor([GRID] * rows)}


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = tiny_qwen2_vl()
    engine, _, _, _ = ds_tsp.initialize(model=model, optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
                                        config=load_ds_config(args.deepspeed_config))
    topology = engine.tsp_topology
    rows = engine.train_micro_batch_size_per_gpu()
    held = {"tower": sum(p.numel() for p in engine.module.model.visual.parameters()),
            "decoder": sum(p.numel() for p in engine.module.model.language_model.parameters())}
    whole = tiny_qwen2_vl().model
    if dist.get_rank() == 0:
        print(json.dumps({"tsp": topology.tsp_size, "dp": topology.dp_size, "held per rank": held,
                          "in all": {"tower": sum(p.numel() for p in whole.visual.parameters()),
                                     "decoder": sum(p.numel() for p in whole.language_model.parameters())}}))
    # Each data-parallel replica its own rows; the ranks of a TSP group the same ones.
    generator = torch.Generator().manual_seed(1 + topology.dp_rank)
    losses = []
    for step in range(1, args.steps + 1):
        loss = engine(**batch(rows, generator)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % args.log_every == 0 and dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": round(sum(losses[-args.log_every:]) / args.log_every, 4)}))
    if dist.get_rank() == 0:
        window = min(5, len(losses))
        print(f"caption loss {sum(losses[:window]) / window:.4f} -> {sum(losses[-window:]) / window:.4f}")


if __name__ == "__main__":
    main()
