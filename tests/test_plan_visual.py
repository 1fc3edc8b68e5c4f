"""The planner's vision-language towers (``ds_tsp.planning.visual``): the tower's size read off Hugging Face's
model on the meta device equals the real tiny models'; TSP's tower states and activations are 1/D of the
baselines' replicated ones; its bytes are ``tsp_visual_bytes_by_op``'s; ``ds-tsp plan``'s video options and
refusals; the presets at 128K and 512K."""

import argparse

import pytest
from torch import nn

from ds_tsp.blocks.tower import tower_units
from ds_tsp.planning import GB, plan
from ds_tsp.planning.cli import add_plan_arguments, run_plan
from ds_tsp.planning.plan_types import VISION_GATHER, VISION_GRADS, VISION_ROWS
from ds_tsp.planning.shapes import model_fields
from ds_tsp.planning.visual import TOWER_ACTIVATIONS, TOWER_STATES, tsp_visual_bytes_by_op, vision_shape
from vision_models import tiny_vlm

ARCHS = {"qwen2_vl": ("model.visual",), "qwen3_vl": ("model.visual",),
         "llava": ("model.vision_tower", "model.multi_modal_projector"),
         "gemma3": ("model.vision_tower", "model.multi_modal_projector"),
         "mistral3": ("model.vision_tower", "model.multi_modal_projector")}
VIDEO_TOKENS = 4096  # of the 32K sequences below


def _shard_units(module):
    """The parameter counts of ``ds_tsp.blocks.tower.shard_tower``'s units of ``module``."""
    if any(True for _ in module.parameters(recurse=False)) and \
            not any(isinstance(m, nn.ModuleList) for m in module.modules()):
        return [sum(p.numel() for p in module.parameters())]
    return [sum(p.numel() for p in unit.parameters()) for unit in tower_units(module).values()]


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_tower_equals_the_real_tiny_models(arch):
    model = tiny_vlm(arch)
    vision = vision_shape(model.config.to_dict())
    towers = [model.get_submodule(path) for path in ARCHS[arch]]
    real = sum(p.numel() for tower in towers for p in tower.parameters())
    units = [numel for tower in towers for numel in _shard_units(tower)]
    print(f"{arch}: meta {vision.params}, real {real}, units {vision.unit_numels}")
    assert vision.params == real
    assert list(vision.unit_numels) == units
    config = model.config.vision_config
    assert vision.layers == (getattr(config, "depth", None) or config.num_hidden_layers)


def test_text_models_have_no_tower():
    assert vision_shape(model_fields("qwen3.5-27b")) is None
    assert vision_shape(model_fields("llama3-8b")) is None
    with pytest.raises(ValueError, match="no vision tower"):
        plan("qwen3.5-27b", 32768, 1, 8, visual_tokens=VIDEO_TOKENS)


def _by_name(plans):
    return {p.name: p for p in plans}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tsp_holds_a_dth_of_the_tower_and_its_patches(checkpointing):
    """Without ZeRO the baselines hold the tower whole; TSP(D) holds ceil(numel/D) of each unit (at most one
    element a unit above 1/D) and encodes 1/D of the patches: its saved tensors, less the gathered units
    autograd keeps, are the baselines' over D."""
    D = 8
    plans = _by_name(plan("qwen3-vl-8b", 32768, 1, D, activation_checkpointing=checkpointing,
                          visual_tokens=VIDEO_TOKENS))
    tsp, dp, ulysses = plans[f"TSP({D})"], plans[f"DP({D})"], plans[f"SP-Ulysses({D})"]
    v, e = tsp.setting.vision, tsp.setting.precision.element
    bytes_per_param = 16
    assert dp.tower["states"] == ulysses.tower["states"] == v.params * bytes_per_param
    excess = tsp.tower["states"] * D - dp.tower["states"]
    print(f"tower states per device: TSP {tsp.tower['states'] / GB:.3f} GB, DP {dp.tower['states'] / GB:.3f} GB; "
          f"D x TSP - DP = {excess} B")
    assert 0 <= excess <= len(v.unit_numels) * (D - 1) * bytes_per_param
    assert tsp.tower["patches"] * D == dp.tower["patches"] == VIDEO_TOKENS * v.patches_per_token
    kept_units = sum(v.unit_numels) - (sum(v.recomputed_numels) if checkpointing else 0)
    assert (tsp.tower["activations"] - kept_units * e) * D == pytest.approx(dp.tower["activations"], rel=1e-12)
    for p in plans.values():  # the peak's terms still sum to it, the tower's among them
        assert sum(p.terms.values()) == pytest.approx(p.total, rel=1e-12)
        assert p.terms[TOWER_STATES] == p.tower["states"]
        assert p.terms[TOWER_ACTIVATIONS] == p.tower["activations"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tsp_tower_bytes_are_the_counted_formulas(checkpointing):
    """The TSP plan's tower parts equal ``tsp_visual_bytes_by_op`` (the formula tests/test_vision_language.py
    checks against counted bytes), and they are all the step's bytes the video adds."""
    D = 4
    with_video = _by_name(plan("qwen3-vl-8b", 32768, 2, D, activation_checkpointing=checkpointing,
                               visual_tokens=VIDEO_TOKENS))[f"TSP({D})"]
    text = _by_name(plan("qwen3-vl-8b", 32768, 2, D, activation_checkpointing=checkpointing))[f"TSP({D})"]
    v = with_video.setting.vision
    expected = tsp_visual_bytes_by_op(v.unit_numels, v.text_hidden_size, 2 * VIDEO_TOKENS, D, 2,
                                      features=v.features,
                                      recomputed_numels=v.recomputed_numels if checkpointing else ())
    parts = with_video.comm_parts
    planned = {"all_gather": parts[VISION_GATHER].nbytes, "reduce_scatter": parts[VISION_GRADS].nbytes,
               "all_to_all": parts[VISION_ROWS].nbytes}
    print(f"TSP({D}) tower bytes per step: {planned}")
    assert planned == {op: float(nbytes) for op, nbytes in expected.items()}
    assert with_video.comm_per_step - text.comm_per_step == pytest.approx(sum(planned.values()), rel=1e-12)


def _run(argv, capsys):
    args = add_plan_arguments(argparse.ArgumentParser()).parse_args(argv)
    status = run_plan(args)
    return status, capsys.readouterr()


def test_cli_refuses_a_video_longer_than_the_sequence(capsys):
    status, captured = _run(["--model", "qwen3-vl-8b", "--seq-len", "8K", "--video-frames", "64"], capsys)
    print(captured.err)
    assert status == 1
    assert "--video-frames 64" in captured.err and "--video-tokens-per-frame 196" in captured.err
    assert "--seq-len" in captured.err


def test_cli_refuses_a_video_for_a_text_model(capsys):
    status, captured = _run(["--model", "qwen3.5-27b", "--video-frames", "8"], capsys)
    print(captured.err)
    assert status == 1
    assert "--video-frames" in captured.err and "no vision tower" in captured.err


def test_cli_prints_the_tower_table(capsys):
    status, captured = _run(["--model", "qwen3-vl-8b", "--seq-len", "32K", "--video-frames", "16",
                             "--video-tokens-per-frame", "256"], capsys)
    assert status == 0
    assert "Vision tower per device" in captured.out and "4,096 visual tokens" in captured.out


@pytest.mark.parametrize("model", ["qwen3-vl-8b", "qwen3.5-27b-vl"])
@pytest.mark.parametrize("seq_len", [128 * 1024, 512 * 1024])
def test_presets_plan_long_videos(model, seq_len):
    """Half of each sequence video (frames of the tower's default tokens), 8 devices, ZeRO-3, checkpointing:
    TSP's peak is below DeepSpeed-Ulysses + ZeRO-3's, which runs the whole tower over every patch."""
    frame_tokens = vision_shape(model_fields(model)).frame_tokens
    visual_tokens = seq_len // 2 // frame_tokens * frame_tokens
    plans = _by_name(plan(model, seq_len, 1, 8, zero_stage=3, activation_checkpointing=True,
                          visual_tokens=visual_tokens))
    tsp, ulysses, fsdp = plans["TSP(8)"], plans["SP-Ulysses(8)"], plans["DP(8)"]
    for p in (tsp, ulysses, fsdp):
        print(f"{model} S={seq_len} video {visual_tokens}: {p.name} peak {p.total / GB:.1f} GB (tower states "
              f"{p.tower['states'] / GB:.2f}, saved {p.tower['activations'] / GB:.2f}), "
              f"{p.comm_per_step / GB:.1f} GB/step")
        assert p.feasible
    assert tsp.total < ulysses.total
