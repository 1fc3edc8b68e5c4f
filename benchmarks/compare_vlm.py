"""TSP against DeepSpeed's parallelisms on a vision-language model, on CPU gloo
ranks: a Qwen3-VL-shaped model at ``compare.py``'s width (its text decoder
hidden 512, 4 layers, vocabulary 32,000; a tower of ``--tower-layers`` blocks
of ``--tower-hidden``, deepstack on, as Qwen3-VL) trained on one row holding
a video of growing length (``--seq-lens``: the row's tokens, about 3/4 of
them the video's: temporal patches of 8 x 8 patches of 16 x 16 pixels, each
merged 2 x 2 to 16 placeholders after a timestamp, as Qwen3-VL's processor
writes videos).

Strategies (each measured as ``compare.py`` measures: peak live-tensor bytes
of a step, bytes received per rank per step, step time, the loss against the
single process's):

* ``single``: one process (DeepSpeed engine, ZeRO-0), the reference;
* ``tsp``: ``ds_tsp.initialize`` with ``tsp.size = D``: the decoder as TSP
  blocks, the tower's work shared over the group by patch count and its
  weights held 1/D a rank (``ds_tsp.blocks.tower``), the visual rows sent to
  their tokens' ranks;
* ``tsp_tower_repeated``: the same decoder, but every rank runs the whole
  tower on the whole video with the tower's weights whole (what a sequence-
  parallel path that does not split the tower does: verl's Ulysses), each
  rank keeping its own tokens' rows; its tower gradients summed over the
  group like any replicated parameter's;
* ``zero3``: ZeRO-3 over the D ranks, every rank the whole row (FSDP's
  layout for one sequence), the tower included;
* ``ulysses``, ``ulysses_zero3``, ``autotp``: DeepSpeed-Ulysses (ZeRO-0 and
  ZeRO-3) and AutoTP, run where DeepSpeed builds them for this model, their
  refusal reported where it does not.

    python benchmarks/compare_vlm.py                                  # benchmarks/results/compare_vlm.md
    python benchmarks/compare_vlm.py --seq-lens 256 --tower-layers 1 --out /tmp/cmp   # a smoke run

Writes ``<name>.md`` and ``<name>.json`` under ``--out``.
"""

import argparse
import json
import os
import shlex
import sys
import time
from unittest import mock

import compare
import deepspeed
import torch
import transformers
from compare import FullSequenceRun, adamw, ds_config, measure_batch, zero3_buckets
from compare_model import add_model_arguments
from ranks import run_on_ranks
from report import summarize
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

import ds_tsp
from ds_tsp.parallel import layout

# Placeholder and delimiter ids at the top of the vocabulary; Qwen3-VL's mm_token_type_ids for a video token.
VIDEO, VISION_START, VISION_END, TIMESTAMP = 31999, 31998, 31997, 31996
VIDEO_TYPE = 2
PATCH, TEMPORAL_PATCH, MERGE, GRID = 16, 2, 2, 8  # a temporal patch: GRID x GRID patches, merged MERGE x MERGE
TOKENS_PER_TEMPORAL_PATCH = GRID * GRID // MERGE ** 2
VIDEO_SHARE = 0.75  # of a row's tokens


def vlm_config(args):
    """Qwen3-VL's proportions at the benchmark's width: M-RoPE over a head of 64 (16 / 8 / 8 frequencies,
    interleaved), deepstack features from the tower's middle and last blocks."""
    head_dim = args.hidden // args.heads
    text = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=head_dim, max_position_embeddings=4 * max(args.seq_lens), tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                                 "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]})
    vision = dict(depth=args.tower_layers, hidden_size=args.tower_hidden, intermediate_size=4 * args.tower_hidden,
                  num_heads=args.tower_hidden // 64, patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH,
                  spatial_merge_size=MERGE, in_channels=3, out_hidden_size=args.hidden,
                  num_position_embeddings=GRID * GRID,
                  deepstack_visual_indexes=sorted({args.tower_layers // 2, args.tower_layers - 1}))
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=VIDEO - 4, video_token_id=VIDEO,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    return config


def build_vlm(args):
    """The same weights on every rank of every strategy (seeded)."""
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(vlm_config(args)).float()


def temporal_patches(seq_len):
    """The video's temporal patches in a row of ``seq_len`` tokens (each its placeholders, delimiters and a
    timestamp)."""
    return max(1, int(VIDEO_SHARE * seq_len) // (TOKENS_PER_TEMPORAL_PATCH + 3))


def video_batch(args, seq_len):
    """One row of ``seq_len`` tokens: text, the video (``temporal_patches``), text; labels on the text only."""
    generator = torch.Generator().manual_seed(seq_len)
    t = temporal_patches(seq_len)
    video = [TIMESTAMP, VISION_START] + [VIDEO] * TOKENS_PER_TEMPORAL_PATCH + [VISION_END]
    head = 8
    tail = seq_len - head - t * len(video)
    text = torch.randint(0, VIDEO - 8, (seq_len,), generator=generator)
    ids = torch.cat([text[:head], torch.tensor(video * t), text[head:head + tail]]).unsqueeze(0)
    types = (ids == VIDEO).long() * VIDEO_TYPE
    labels = ids.masked_fill((ids >= VIDEO - 8), -100)
    grid = torch.tensor([[t, GRID, GRID]])
    pixels = torch.randn(t * GRID * GRID, 3 * TEMPORAL_PATCH * PATCH * PATCH, generator=generator)
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": types, "pixel_values_videos": pixels,
            "video_grid_thw": grid}


def measure(run, seq_len, args):
    return measure_batch(run, video_batch(args, seq_len), args)


# --- the strategies ------------------------------------------------------------------------------------------------

def tsp_config(args, world):
    return ds_config(args, tsp={"enabled": True, "size": world, "layout": compare.TSP_LAYOUT,
                                "attention_backend": "sdpa"})


def run_single(world, args):
    return FullSequenceRun(compare._deepspeed_engine(build_vlm(args), ds_config(args)))


def run_tsp(world, args):
    engine, *_ = ds_tsp.initialize(model=build_vlm(args), optimizer=adamw, config=tsp_config(args, world))
    return FullSequenceRun(engine)


def run_tsp_tower_repeated(world, args):
    """``run_tsp`` with the tower whole on every rank, run on every item (patched for this rank's process)."""
    from ds_tsp.injection import inject, multimodal
    mock.patch.object(inject, "shard_tower", lambda *args: None).start()
    mock.patch.object(multimodal.VisualInputs, "embed", embed_on_every_rank).start()
    return run_tsp(world, args)


def embed_on_every_rank(visual, hidden, token_ids, topology, layout_name):
    """``VisualInputs.embed`` with the whole tower run here on every item, each of this rank's placeholders
    taking its row from this rank's own copy (no all-to-all); items of one placeholder id (the benchmark's
    video, its temporal patches), whose rows fill the placeholders in row order."""
    from ds_tsp.blocks.visual import VisualRoute
    items = visual.items(token_ids)
    if len({item.token_id for item in items}) != 1:
        raise ValueError("tsp_tower_repeated takes items of one placeholder id (a video, or images) a batch")
    encoded = torch.cat([torch.cat(feature) for feature in visual.encode(items, list(range(len(items))))], dim=-1)
    batch, seq_len = token_ids.shape
    flat = torch.arange(batch * seq_len).view(batch, seq_len)
    mine = layout.shard(flat, topology.tsp_rank, topology.tsp_size, layout_name).reshape(-1)
    placeholders = (token_ids.reshape(-1) == items[0].token_id).nonzero().squeeze(1)
    rows = encoded[torch.isin(placeholders, mine)].split(hidden.shape[-1], dim=-1)
    # Rows of one placeholder id land in placeholder order, which is the route's slot order (sources in rank
    # order, each its contiguous share of the items).
    visual.route = VisualRoute(items, token_ids, topology.tsp_rank, topology.tsp_size, layout_name)
    visual.deepstack = rows[1:]
    return visual.route.place(hidden, rows[0])


def run_zero3(world, args):
    config = ds_config(args, zero_stage=3)
    config["zero_optimization"].update(zero3_buckets(args))
    return FullSequenceRun(compare._deepspeed_engine(build_vlm(args), config))


class VisualUlyssesRun(compare.UlyssesRun):
    """``UlyssesRun`` fed as a VLM would have to be: each rank its contiguous chunk of the row's ids, token
    types, labels and M-RoPE positions (computed on the whole row by the model's ``get_rope_index``), and the
    whole video, which Hugging Face's forward encodes and scatters into the chunk's placeholders."""

    def step(self, batch):
        sp_size, sp_rank = compare.dist.get_world_size(self.sp_group), compare.dist.get_rank(self.sp_group)
        seq_len = batch["input_ids"].shape[1]
        inner = self.engine.module.model
        positions, _ = inner.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                            video_grid_thw=batch["video_grid_thw"])
        own = slice(sp_rank * seq_len // sp_size, (sp_rank + 1) * seq_len // sp_size)
        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=compare.IGNORE_INDEX)[:, 1:][:, own]
        logits = self.engine(input_ids=batch["input_ids"][:, own], mm_token_type_ids=batch["mm_token_type_ids"][:, own],
                             position_ids=positions[..., own], pixel_values_videos=batch["pixel_values_videos"],
                             video_grid_thw=batch["video_grid_thw"]).logits
        return self.finish(logits, labels)


def run_ulysses(world, args):
    run = compare.run_ulysses(world, args, build=build_vlm)
    return VisualUlyssesRun(run.engine, run.sp_group, run.backward_scale)


def run_ulysses_zero3(world, args):
    run = compare.run_ulysses_zero3(world, args, build=build_vlm)
    return VisualUlyssesRun(run.engine, run.sp_group, run.backward_scale)


def run_autotp(world, args):
    return compare.run_autotp(world, args, build=build_vlm)


STRATEGIES = {"single": run_single, "tsp": run_tsp, "tsp_tower_repeated": run_tsp_tower_repeated,
              "zero3": run_zero3, "ulysses": run_ulysses, "ulysses_zero3": run_ulysses_zero3,
              "autotp": run_autotp}
LABELS = {"single": "single process", "tsp": "TSP", "tsp_tower_repeated": "TSP, tower repeated on every rank",
          "zero3": "ZeRO-3 (FSDP layout)", "ulysses": "Ulysses", "ulysses_zero3": "Ulysses + ZeRO-3",
          "autotp": "AutoTP"}


# --- report --------------------------------------------------------------------------------------------------------

def tabulate(results, args):
    """Per length, per strategy: peak and state MiB (largest rank), bytes received a step (largest rank), step
    time, the largest loss difference from the single process, or its refusal."""
    reference = {s: cell[0]["losses"] for s, cell in results["single"].items() if not isinstance(cell, str)}
    rows = []
    for name, by_length in results.items():
        for seq_len, cell in by_length.items():
            row = {"strategy": name, "seq_len": seq_len, "video_tokens": temporal_patches(seq_len)
                   * TOKENS_PER_TEMPORAL_PATCH, "patches": temporal_patches(seq_len) * GRID * GRID}
            if isinstance(cell, str):
                rows.append({**row, "unsupported": cell})
                continue
            summary = summarize(cell, reference.get(seq_len))
            rows.append({**row, **summary})
    return rows


def write_report(rows, args, meta):
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# {LABELS['tsp']} on a vision-language model (Qwen3-VL-shaped), CPU ranks, D = {args.size}", "",
             f"`{meta['command']}`", "",
             f"Model: {json.dumps(meta['model'])}. One row a step, fp32, AdamW; torch {meta['torch']}, "
             f"DeepSpeed {meta['deepspeed']}, transformers {meta['transformers']}, {meta['cpu_count']} CPUs.", "",
             "| tokens (video) | patches | strategy | peak MiB | state MiB | received MiB / step | step s | "
             "max loss diff |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        head = f"| {row['seq_len']} ({row['video_tokens']}) | {row['patches']} | {LABELS[row['strategy']]} |"
        if "unsupported" in row:
            lines.append(f"{head} {row['unsupported'][:160]} |||||")
            continue
        lines.append(f"{head} {row['peak_live_mib']:.1f} | {row['state_mib']:.1f} | "
                     f"{row['received_mib_per_step']:.2f} | {row['step_s']:.2f} | {_loss_diff(row)} |")
    lines += ["", *verdict(rows)]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return stem + ".md"


def verdict(rows):
    """Per length, whether TSP's peak is the lowest of the strategies that ran, and by how much; and why those
    that did not run refused."""
    lines = []
    for seq_len in sorted({row["seq_len"] for row in rows}):
        ran = {row["strategy"]: row["peak_live_mib"] for row in rows if row["seq_len"] == seq_len
               and "unsupported" not in row}
        if "tsp" not in ran:
            continue
        others = {name: peak for name, peak in ran.items() if name != "tsp"}
        lowest = min(others, key=others.get)
        word = "the lowest" if ran["tsp"] < others[lowest] else "NOT the lowest"
        lines.append(f"* {seq_len} tokens: TSP's peak {ran['tsp']:.0f} MiB is {word}; next {LABELS[lowest]} "
                     f"{others[lowest]:.0f} MiB ({others[lowest] / ran['tsp']:.2f}x).")
    refused = {row["strategy"]: row["unsupported"] for row in rows if "unsupported" in row}
    lines += [f"* {LABELS[name]} did not run: {reason}" for name, reason in refused.items()]
    return lines


def _loss_diff(row):
    diff = row.get("max_loss_diff_vs_single")
    return "-" if diff is None else f"{diff:.1e}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2, help="ranks D of every parallel strategy")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES)[1:], choices=list(STRATEGIES)[1:])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    add_model_arguments(parser)
    parser.add_argument("--tower-layers", type=int, default=4)
    parser.add_argument("--tower-hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--strategy-timeout", type=float, default=900)
    parser.add_argument("--collective-timeout", type=float, default=120)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="compare_vlm")
    args = parser.parse_args(argv)
    args.seq_lens = sorted(args.seq_lens)
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.size):
            parser.error(f"--seq-lens {seq_len} is not a multiple of 2*D = {2 * args.size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS"))
    command = f"{env} " + " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    start = time.monotonic()
    results = {"single": run_on_ranks(run_single, measure, args.seq_lens, 1, args)}
    for name in args.strategies:
        results[name] = run_on_ranks(STRATEGIES[name], measure, args.seq_lens, args.size, args)
        print(f"[{time.monotonic() - start:.0f} s] {name}: "
              f"{ {s: 'ok' if not isinstance(v, str) else v[:100] for s, v in results[name].items()} }", flush=True)
    config = vlm_config(args)
    meta = {"command": command, "elapsed_s": time.monotonic() - start, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "model": {"arch": "Qwen3VLForConditionalGeneration", "hidden": args.hidden, "layers": args.layers,
                      "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
                      "tower_layers": args.tower_layers, "tower_hidden": args.tower_hidden,
                      "deepstack": config.vision_config.deepstack_visual_indexes}}
    print(open(write_report(tabulate(results, args), args, meta)).read())


if __name__ == "__main__":
    main()
