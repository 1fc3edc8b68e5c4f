"""Vision-language models under TSP against the unsharded Hugging Face model, float64 (DESIGN.md 6m)."""

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_tsp
from ds_tsp.blocks.tower import ShardedUnit
from ds_tsp.blocks.visual import VisualItem, share_items
from ds_tsp.config import TSPConfig
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel.topology import TSPTopology
from float32_control import float32_bound, relative_errors
from parity import TOLERANCE, check, check_caught, held_pieces, shard_grad_diffs, sharded_units
from vision_models import PATCH, packed_documents, packed_visual_batch, tiny_vlm, visual_batch

# Rows of 48 tokens: D = 4 cuts them into 8 chunks of 6, so every image below straddles chunks (and ranks).
ONE_IMAGE_EACH = [[("text", 5), ("image", (1, 4, 6)), ("text", 35)],
                  [("text", 3), ("image", (1, 6, 4)), ("text", 10), ("image", (1, 2, 4)), ("text", 23)]]
WITH_A_TEXT_ROW = [ONE_IMAGE_EACH[0], [("text", 48)], [("text", 7), ("image", (1, 4, 4)), ("text", 30), ("pad", 5)]]
WITH_A_VIDEO = [[("text", 4), ("video", (3, 4, 4)), ("text", 4), ("image", (1, 2, 4)), ("text", 22)],
                [("text", 2), ("image", (1, 4, 4)), ("text", 30), ("pad", 10)]]
# Families that take images only.
IMAGES_ONLY = ("llava", "gemma3", "mistral3")
# Families whose packed rows are checked against Hugging Face's forward of each document alone
# (``reference_loss_by_document`` says why).
BY_DOCUMENT = ("gemma3", "qwen3_5", "qwen3_5_moe")
# Families whose tower takes whole images of one size (the tests count images, not patches).
WHOLE_IMAGES = ("llava", "gemma3")
# Families whose processors write each temporal patch of a video as its own run of placeholders.
FRAMES_APART = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
CASES = {"one image each, two in a row": ONE_IMAGE_EACH, "a row without images, padding": WITH_A_TEXT_ROW,
         "a video of three temporal patches": WITH_A_VIDEO}


def vlm_parity(rows, arch="qwen2_vl", layout="zigzag", wrong=None, packed=False, checkpointing=False,
               left_padded=False, **tsp_options):
    """On every rank: |loss - HF loss| and every gradient's max |diff| (vision
    tower included), and how many patches this rank's tower encoded.
    ``wrong``: "route" puts each received visual row one placeholder on,
    "positions" hands the layers each token's index in its row on all three
    M-RoPE axes (text positions, as a rotary embedding unaware of images would),
    "deepstack" drops the tower's features added after the first decoder layers,
    "tower" scales the last rank's slice of the tower's first block by 1.5,
    "mask" drops Gemma 3's image-block mask (every token causal).
    ``left_padded``: the padded rows padded on the left, as TRL's trainers pad
    (their first real token takes no loss: Hugging Face predicts it from padding).
    Qwen2.5-VL's videos come with ``second_per_grid_ts`` (2 s a temporal patch)."""
    tsp_size = dist.get_world_size()
    ref = tiny_vlm(arch)
    batch = packed_visual_batch(ref, rows, frames_apart=arch in FRAMES_APART) if packed else \
        visual_batch(rows, frames_apart=arch in FRAMES_APART, llava=arch == "llava", pixtral=arch == "mistral3",
                     gemma=arch == "gemma3")
    if left_padded:
        batch = _left_padded(batch, first_unlabelled=True)
    if arch == "qwen2_5_vl" and "video_grid_thw" in batch:
        batch["second_per_grid_ts"] = torch.full((len(batch["video_grid_thw"]),), 2.0, dtype=torch.float64)
    ref.zero_grad()
    if packed and arch in BY_DOCUMENT:
        ref_loss = reference_loss_by_document(ref, packed_documents(ref, rows, arch in FRAMES_APART), batch["labels"])
    else:
        ref_loss = reference_loss(ref, batch)
    ref_loss.backward()
    model = copy.deepcopy(ref)
    model.zero_grad()
    topo = TSPTopology(tsp_size)
    ds_tsp.inject(model, topo, TSPConfig(enabled=True, size=tsp_size, layout=layout, attention_backend="sdpa",
                                         **tsp_options))
    if checkpointing:  # Hugging Face's, on the decoder layers and the tower's blocks alike
        model.train()
        model.activation_checkpointing_enable()
    if wrong == "tower" and topo.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            next(unit for unit in model.modules() if isinstance(unit, ShardedUnit)).shard.mul_(1.5)
    encoded = []
    tower_class = type(getattr(model.model, "visual", None) or model.model.vision_tower)
    tower_forward = tower_class.forward

    def counting(tower, pixels=None, *args, **kwargs):  # Qwen's and Pixtral's: patches; LLaVA's, Gemma 3's: images
        if pixels is None:  # Gemma 3 passes them by name
            pixels = kwargs.pop("pixel_values")
        sizes = kwargs.get("image_sizes")
        encoded.append(pixels.shape[0] if sizes is None else int((sizes // PATCH).prod(dim=-1).sum()))
        return tower_forward(tower, pixels, *args, **kwargs)

    with mock.patch.object(tower_class, "forward", counting), _wrong(wrong, tsp_size):
        out = model(**batch)
    out.loss.backward()
    diffs = {"loss": (out.loss - ref_loss).abs().item(), **shard_grad_diffs(model, ref)}
    return {**diffs, "patches": sum(encoded)}


def reference_loss(model, batch):
    """Hugging Face's loss of ``batch``, but in float64 (its loss upcasts the logits to float32 only)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def reference_loss_by_document(model, documents, labels):
    """``reference_loss`` of packed rows (``documents``: ``packed_documents``'), from Hugging Face's logits of
    each document run alone, where its packed forward is no reference:

    * Gemma 3: on its sliding layers the image-block mask is indexed by each token's position in its
      document instead of in the row (transformers 5.25, ``create_masks_for_vision_model``), which moves its
      logits 0.34 from the documents' own; with that mask indexed by the row, its packed logits equal the
      documents' to 3.5e-16;
    * Qwen3.5: its linear-attention layers carry their state across packed documents (their torch path
      ignores the boundaries), as in the text model (``parity.per_document_logits``)."""
    def alone(batch):
        inputs = {key: value for key, value in batch.items() if key not in ("labels", "attention_mask")
                  and not (key.startswith("pixel_values") and not len(value))}
        return model(**inputs, use_cache=False).logits

    logits = torch.cat([torch.cat([alone(document) for document in row], dim=1) for row in documents])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _wrong(wrong, tsp_size):
    """The deliberately wrong piece of a guard, as a patch (or none)."""
    if wrong == "route":
        from ds_tsp.blocks import visual

        original = visual.VisualRoute.__init__

        def shifted(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.slots = self.slots.roll(1)  # each received row one placeholder on
        return mock.patch.object(visual.VisualRoute, "__init__", shifted)
    if wrong == "positions":
        from ds_tsp.injection import model as model_module

        original = model_module.TSPBatch.__init__

        def one_axis(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.rotary_positions = self.position_ids.expand_as(self.rotary_positions)
        return mock.patch.object(model_module.TSPBatch, "__init__", one_axis)
    if wrong == "deepstack":
        from ds_tsp.injection.multimodal import VisualInputs
        return mock.patch.object(VisualInputs, "after_layer", lambda self, index, hidden: hidden)
    if wrong == "mask":
        from ds_tsp.injection.multimodal import GemmaVisualInputs
        return mock.patch.object(GemmaVisualInputs, "spans", lambda self, left_padding: None)
    return mock.patch.dict({})


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "llava",
                                  "gemma3", "mistral3"])
def test_vision_language_models_match_hugging_face(run_ranks, arch, tsp_size):
    for name, rows in CASES.items():
        if arch in IMAGES_ONLY and name == "a video of three temporal patches":
            continue
        per_rank = run_ranks(tsp_size, vlm_parity, rows=rows, arch=arch)
        check([{k: v for k, v in d.items() if k != "patches"} for d in per_rank], f"D={tsp_size} {arch} {name}")
        grids = [size for row in rows for kind, size in row if kind in ("image", "video")]
        # The tower's items: whole images (one each for LLaVA's and Gemma 3's, whose tower counts images), Qwen's
        # temporal patches.
        patches = [1 if arch in WHOLE_IMAGES else h * w for t, h, w in grids for _ in range(t)]
        encoded = [d["patches"] for d in per_rank]
        print(f"D={tsp_size} {arch} {name}: patches encoded per rank {encoded} of {sum(patches)}")
        # Each rank encodes its share (at most total / D + the largest item), or the smallest item where it has none:
        # a video's temporal patches are shared out too.
        assert all(count <= sum(patches) / tsp_size + max(patches) for count in encoded)


# Two rows of two and three documents, images and a video in several of them, straddling the documents' chunks.
PACKED = [[[("text", 5), ("image", (1, 4, 6)), ("text", 9)], [("text", 3), ("video", (2, 4, 4)), ("text", 12)]],
          [[("text", 9)], [("image", (1, 2, 4)), ("text", 6)], [("text", 2), ("image", (1, 4, 4)), ("text", 20)]]]


# PACKED with images only (16 tokens each, straddling their documents' chunks), for Gemma 3.
PACKED_IMAGES = [[[("text", 5), ("image", (1, 4, 6)), ("text", 3)], [("text", 3), ("image", (1, 4, 4)), ("text", 12)]],
                 [[("text", 9)], [("image", (1, 2, 4)), ("text", 6)], [("text", 2), ("image", (1, 4, 4)), ("text", 6)]]]


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "gemma3", "mistral3"])
def test_packed_rows_match_hugging_face(run_ranks, arch, tsp_size):
    """Packed documents with their (4, B, S) positions: attention stops at each document, its M-RoPE restarts,
    Qwen3.5's linear layers restart their state; Gemma 3's images see themselves both ways within their document."""
    check([{k: v for k, v in d.items() if k != "patches"}
           for d in run_ranks(tsp_size, vlm_parity, rows=PACKED_IMAGES if arch in IMAGES_ONLY else PACKED,
                              arch=arch, packed=True)],
          f"D={tsp_size} {arch} packed")


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_gradient_checkpointing_of_the_tower_and_the_decoder_matches_hugging_face(run_ranks, arch):
    check([{k: v for k, v in d.items() if k != "patches"}
           for d in run_ranks(2, vlm_parity, rows=ONE_IMAGE_EACH, arch=arch, checkpointing=True)],
          f"D=2 {arch} checkpointed")


@pytest.mark.parametrize("tsp_size", [2, 4])
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava", "gemma3"])
def test_left_padded_rows_match_hugging_face(run_ranks, arch, tsp_size):
    """Rows padded on the left (TRL's trainers pad so): moved to the right before the layers, their M-RoPE
    positions and visual rows moved with them."""
    for name in ("a row without images, padding", "a video of three temporal patches"):
        if arch in IMAGES_ONLY and name == "a video of three temporal patches":
            continue
        check([{k: v for k, v in d.items() if k != "patches"}
               for d in run_ranks(tsp_size, vlm_parity, rows=CASES[name], arch=arch, left_padded=True)],
              f"D={tsp_size} {arch} {name}, left-padded")


def test_qwen2_vl_contiguous_layout_matches_hugging_face(run_ranks):
    check([{k: v for k, v in d.items() if k != "patches"}
           for d in run_ranks(2, vlm_parity, rows=ONE_IMAGE_EACH, layout="contiguous")], "D=2 contiguous")


@pytest.mark.parametrize("wrong, arch", [("route", "qwen2_vl"), ("positions", "qwen2_vl"), ("deepstack", "qwen3_vl"),
                                         ("tower", "qwen2_vl"), ("mask", "gemma3")])
def test_a_wrong_visual_row_position_or_dropped_deepstack_is_caught(run_ranks, wrong, arch):
    per_rank = run_ranks(2, vlm_parity, rows=ONE_IMAGE_EACH, wrong=wrong, arch=arch)
    check_caught([{k: v for k, v in d.items() if k != "patches"} for d in per_rank], f"wrong {wrong}")


def test_items_are_shared_by_patch_count():
    patches = [24, 24, 8, 48, 16]
    for tsp_size in (1, 2, 3, 4, 8):
        shares = share_items(patches, tsp_size)
        assert [i for share in shares for i in share] == list(range(len(patches)))
        for share in shares:
            assert sum(patches[i] for i in share) <= sum(patches) / tsp_size + max(patches)
    assert [list(s) for s in share_items([10], 2)] == [[0], []]


def test_visual_features_and_placeholders_must_agree():
    from ds_tsp.blocks.visual import VisualRoute
    token_ids = torch.tensor([[1, 60, 60, 2]])
    with pytest.raises(ValueError, match="2 placeholder tokens of id 60 but its images or videos of that kind give 3"):
        VisualRoute([VisualItem(60, 12, 3)], token_ids, 0, 2, "zigzag")


# Each data-parallel replica's micro-batch: its own images, a row without any on the second.
REPLICA_ROWS = [ONE_IMAGE_EACH, WITH_A_TEXT_ROW[1:]]
ENGINE_STEPS = 3
# Adam, and for Qwen3.5 SGD, whose updates do not magnify the rounding of its zero-initialised norms' gradients as
# Adam's do (tests/test_engine.py trains its text model so too): its float32 control then stays far from what a
# run that trained nothing would score.
ENGINE_OPTIMIZERS = {"qwen2_vl": (torch.optim.Adam, 1e-2), "qwen3_5": (torch.optim.SGD, 0.1)}


def vlm_engine_run(tsp_size, zero_stage, arch="qwen2_vl"):
    """A VLM in float32 trained by ``ds_tsp.initialize`` (``ENGINE_OPTIMIZERS``, DeepSpeed's default clipping at 1.0) over
    TSP ``tsp_size`` x the rest data parallel, each replica on its micro-batch; the one-process float32 run on
    the replicas' mean loss is the control, the same run in float64 the truth (tests/float32_control.py).
    Returns each weight's relative error against the truth (this rank's pieces, tower included) and the
    control's, the losses, and the untrained weights' largest relative distance to the truth's (what a run
    that trained nothing would score)."""
    dp_size = dist.get_world_size() // tsp_size
    ref = tiny_vlm(arch, dtype=torch.float32)
    model, truth = copy.deepcopy(ref), copy.deepcopy(ref).double()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": tsp_size, "attention_backend": "sdpa"}}
    optimizer_class, lr = ENGINE_OPTIMIZERS[arch]
    engine, _, _, _ = ds_tsp.initialize(model=model, optimizer=optimizer_class(model.parameters(), lr=lr),
                                        config=config)
    replicas = [[visual_batch(REPLICA_ROWS[r % len(REPLICA_ROWS)], seed=10 * step + r, dtype=torch.float32,
                              frames_apart=arch in FRAMES_APART) for r in range(dp_size)] for step in range(ENGINE_STEPS)]
    losses = []
    for step in replicas:
        loss = engine(**step[engine.tsp_topology.dp_rank]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    for one_process in (ref, truth):
        optimizer = optimizer_class(one_process.parameters(), lr=lr)
        for step in replicas:
            optimizer.zero_grad()
            dtype = next(one_process.parameters()).dtype
            loss = sum(reference_loss(one_process, {k: v.to(dtype) if v.is_floating_point() else v
                                                    for k, v in batch.items()}) for batch in step) / dp_size
            loss.backward()
            torch.nn.utils.clip_grad_norm_(one_process.parameters(), 1.0)
            optimizer.step()
    truth_params = dict(truth.named_parameters())
    units = dict(sharded_units(engine.module))
    with torch.no_grad():
        pieces = {name: (held, full) for name, _, held, full in held_pieces(engine.module, truth_params)}
        # A tower unit's slice is relative to the whole unit's largest weight (a slice may hold only zeros).
        scales = {f"{prefix}.shard": torch.cat([truth_params[f"{prefix}.{n}"].reshape(-1) for n in unit.names])
                  .abs().max() for prefix, unit in units.items()}
    rel = {name: ((held.double() - full).abs().max() / scales.get(name, full.abs().max())).item()
           for name, (held, full) in pieces.items()}
    control = {name: ((param.double() - truth_params[name]).abs().max() / truth_params[name].abs().max()).item()
               for name, param in ref.named_parameters()}
    moved = max(((param - orig).abs().max() / param.abs().max()).item()
                for (_, param), orig in zip(truth.named_parameters(), tiny_vlm(arch, dtype=torch.float64).parameters()))
    return dict(rel=rel, control=control, losses=losses, moved=moved)


@pytest.mark.parametrize("world, tsp_size, zero_stage", [(4, 2, 2), (2, 2, 3)])
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_5"])
def test_engine_trains_a_vlm_like_one_process(run_ranks, world, tsp_size, zero_stage, arch):
    per_rank = run_ranks(world, vlm_engine_run, tsp_size=tsp_size, zero_stage=zero_stage, arch=arch, timeout_s=300)
    worst = max(max(d["rel"].values()) for d in per_rank)
    name = max(per_rank[0]["rel"], key=per_rank[0]["rel"].get)
    control = max(per_rank[0]["control"].values())
    tower = max(v for d in per_rank for k, v in d["rel"].items() if ".visual." in k)
    print(f"{arch}, TSP {tsp_size} x DP {world // tsp_size}, ZeRO-{zero_stage}: max rel |dw| against float64 {worst:.2e} "
          f"({name}; the tower's {tower:.2e}), the float32 control's {control:.2e}; training moved the weights "
          f"{per_rank[0]['moved']:.2e}; losses {[round(v, 5) for v in per_rank[0]['losses']]}")
    assert per_rank[0]["moved"] > 10 * float32_bound([control])  # the comparison could tell trained from not
    assert worst <= float32_bound([control])


def _meta_vlm(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def test_towers_ds_tsp_does_not_split_are_refused_by_name():
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, PaliGemmaConfig,
                              PaliGemmaForConditionalGeneration)
    from ds_tsp.injection.policy import resolve_policy
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4)
    # LLaVA-NeXT: images tiled at any resolution; PaliGemma: a prefix (image and prompt) attended both ways.
    for model_class, config in (
            (LlavaNextForConditionalGeneration, LlavaNextConfig(text_config={"model_type": "llama", **text},
                                                                vision_config={"model_type": "clip_vision_model",
                                                                               **vision})),
            (PaliGemmaForConditionalGeneration, PaliGemmaConfig(text_config={"model_type": "gemma", **text},
                                                                vision_config=vision))):
        with pytest.raises(PolicyError, match=f"{model_class.__name__} is a vision-language model whose vision tower "
                                              r"ds_tsp does not split yet \(it holds \['vision_tower'"):
            resolve_policy(_meta_vlm(model_class, config))


def test_text_only_generation_gives_hugging_face_tokens(run_ranks):
    for tokens, expected in run_ranks(2, text_generation):
        assert tokens == expected


def text_generation():
    """Greedy tokens of the injected Qwen2-VL on a text prompt, and the unsharded model's."""
    ref = tiny_vlm()
    model = copy.deepcopy(ref)
    ds_tsp.inject(model, TSPTopology(2), TSPConfig(enabled=True, size=2, attention_backend="sdpa"))
    prompt = torch.arange(1, 9).unsqueeze(0)
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, pad_token_id=0, do_sample=False)
    return model.generate(prompt, **options).tolist(), ref.generate(prompt, **options).tolist()


def test_pipeline_stages_of_a_vlm_are_refused():
    from ds_tsp.injection.pipeline import check_pipeline_stages
    with pytest.raises(ValueError, match="tsp.pipeline_stages = 2 with a vision-language model \\(Qwen2VLConfig\\)"):
        check_pipeline_stages(tiny_vlm().config, TSPConfig(enabled=True, size=2, pipeline_stages=2))



def vlm_round_trip(source, saved, trained, arch="qwen2_vl"):
    """``ds_tsp.from_pretrained`` of Hugging Face's own save of a tiny ``arch`` (Qwen2-VL's files in the original
    layout: ``visual.*``, ``model.layers.*``), then (``trained``) one SGD step on an image batch, then
    ``ds_tsp.save_pretrained``, loaded back by the class's ``from_pretrained``. Returns the loss of the model
    read against Hugging Face's load of the same files injected in memory, the names the two checkpoints
    disagree on, and the largest difference of every tensor this rank holds against the reloaded model's
    (trained) or the original's."""
    ref = tiny_vlm(arch)
    if dist.get_rank() == 0:
        ref.save_pretrained(source)
    dist.barrier()
    tsp_size = dist.get_world_size()
    topo, config = TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa")
    model = ds_tsp.from_pretrained(source, topo, config)
    # Hugging Face's own load of the files: its non-persistent buffers as its loads make them (Gemma 3's
    # embedding scale in float64, where the model built in float32 and cast holds float32's rounding of it).
    in_memory = type(ref).from_pretrained(source, dtype=torch.float64)
    ds_tsp.inject(in_memory, topo, config)
    batch = visual_batch(ONE_IMAGE_EACH, gemma=arch == "gemma3")
    loss = model(**batch).loss
    same_loss = loss.item() == in_memory(**batch).loss.item()
    if trained:
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.sub_(0.1 * param.grad)
    ds_tsp.save_pretrained(model, saved, overwrite=True)
    dist.barrier()
    reloaded = type(ref).from_pretrained(saved, dtype=torch.float64)
    expected = dict(reloaded.state_dict()) if trained else dict(ref.state_dict())
    missing = sorted(set(ref.state_dict()) ^ set(reloaded.state_dict()))
    worst = max((held.double() - full.double()).abs().max().item()
                for _, _, held, full in held_pieces(model, expected))
    moved = max((a - b).abs().max().item() for a, b in zip(reloaded.state_dict().values(), ref.state_dict().values()))
    return dict(same_loss=same_loss, missing=missing, worst=worst, moved=moved)


@pytest.mark.parametrize("tsp_size", [2, 4])
@pytest.mark.parametrize("trained", [False, True])
def test_from_pretrained_then_save_pretrained_is_bit_exact(run_ranks, tmp_path, tsp_size, trained):
    per_rank = run_ranks(tsp_size, vlm_round_trip, source=str(tmp_path / "hf"), saved=str(tmp_path / "tsp"),
                         trained=trained)
    print(f"D={tsp_size} trained={trained}: {per_rank[0]}")
    for result in per_rank:
        assert result["same_loss"] and result["missing"] == [] and result["worst"] == 0.0
        assert (result["moved"] > 0) == trained  # the step moved the saved weights (or nothing did)


def test_gemma3_round_trip_is_bit_exact(run_ranks, tmp_path):
    """Gemma 3's SigLIP tower and its projector (one unit: a norm and a bare projection matrix), trained at D=2."""
    for result in run_ranks(2, vlm_round_trip, source=str(tmp_path / "hf"), saved=str(tmp_path / "tsp"),
                            trained=True, arch="gemma3"):
        assert result["same_loss"] and result["missing"] == [] and result["worst"] == 0.0 and result["moved"] > 0


# Prompts of one image and two (``_left_padded`` pads the shorter on the left, as generation pads prompts).
PROMPTS = [[("text", 3), ("image", (1, 4, 6)), ("text", 4)],
           [("text", 2), ("image", (1, 2, 4)), ("text", 3), ("image", (1, 4, 4)), ("text", 6)]]


def generation_with_images(arch, tsp_size, wrong=False):
    """Hugging Face's generate (greedy) on the injected model and on the unsharded one, for image prompts and a
    video prompt: whether the tokens are the same, the largest difference of the steps' logits (which generate
    hands out in float32) and the largest logit.
    ``wrong``: the new tokens rotate at their text positions, without the prompt's rope_deltas."""
    from ds_tsp.inference import generate

    ref = tiny_vlm(arch)
    model = copy.deepcopy(ref)
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    prefill = generate.TSPDecoder.prefill

    def without_deltas(self, *args, **kwargs):
        cache, logits = prefill(self, *args, **kwargs)
        cache.rope_deltas.zero_()
        return cache, logits

    patches = (mock.patch.object(generate.TSPDecoder, "prefill", without_deltas),
               mock.patch.object(generate, "_positions_continue", lambda *args: torch.tensor(True))) if wrong else ()
    results = []
    for rows in (PROMPTS,) if arch in IMAGES_ONLY else (PROMPTS, WITH_A_VIDEO[:1]):
        batch = _left_padded(visual_batch(rows, seed=3, frames_apart=arch in FRAMES_APART, llava=arch == "llava",
                                          pixtral=arch == "mistral3", gemma=arch == "gemma3"))
        batch.pop("labels")
        options = dict(max_new_tokens=5, pad_token_id=0, do_sample=False, output_logits=True,
                       return_dict_in_generate=True)
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            mine = model.generate(**batch, **options)
        expected = ref.generate(**batch, **options)
        results.append((torch.equal(mine.sequences, expected.sequences),
                        max((a - b).abs().max().item() for a, b in zip(mine.logits, expected.logits)),
                        max(b.abs().max().item() for b in expected.logits)))
    return results


def _left_padded(batch, first_unlabelled=False):
    """``visual_batch``'s right-padded rows moved to the left, as generation pads prompts;
    ``first_unlabelled``: a left-padded row's first real token takes no loss."""
    lengths = batch["attention_mask"].sum(dim=1)
    width = batch["input_ids"].shape[1]
    index = (torch.arange(width).unsqueeze(0) - (width - lengths).unsqueeze(1)) % width
    for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids"):
        if key in batch:
            batch[key] = batch[key].gather(1, index)
    if first_unlabelled:
        rows = (lengths < width).nonzero().squeeze(1)
        batch["labels"][rows, width - lengths[rows]] = -100
    return batch


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "qwen3_5", "llava", "gemma3", "mistral3"])
def test_generation_with_images_gives_hugging_face_tokens(run_ranks, arch):
    per_rank = run_ranks(2, generation_with_images, arch=arch, tsp_size=2)
    print(f"{arch}: logits within {max(diff for rank in per_rank for _, diff, _ in rank):.1e} of Hugging Face's")
    # float64 logits that agree to ~1e-14 agree in float32 to its last bit: one ulp of the largest logit.
    assert all(same and diff <= torch.finfo(torch.float32).eps * scale for rank in per_rank
               for same, diff, scale in rank)


def test_new_tokens_rotating_without_the_prompts_rope_deltas_are_caught(run_ranks):
    per_rank = run_ranks(2, generation_with_images, arch="qwen2_vl", tsp_size=2, wrong=True)
    moved = min(max(diff / (torch.finfo(torch.float32).eps * scale) for _, diff, scale in rank) for rank in per_rank)
    print(f"without rope_deltas: logits move by {moved:.0f} float32 ulps of the largest")
    assert moved > 100


def vlm_lora_parity(arch):
    """PEFT LoRA on the text decoder's seven projections of a tiny ``arch``, the tower and the rest frozen (the
    common recipe), injected as a ``PeftModel``: |loss diff| against the PEFT model on an image batch, and the
    max |diff| of every adapter gradient this rank holds; what trains and what got a gradient though frozen."""
    from peft import LoraConfig, get_peft_model
    from test_lora import ALL_TARGETS, adapter_pieces

    torch.manual_seed(0)
    targets = rf".*language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(ALL_TARGETS)})"
    ref = get_peft_model(tiny_vlm(arch), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    init_lora_weights=False))
    model = copy.deepcopy(ref)
    tsp_size = dist.get_world_size()
    tsp_model = ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size,
                                                                       attention_backend="sdpa"))
    batch = visual_batch(ONE_IMAGE_EACH, frames_apart=arch in FRAMES_APART)
    loss = tsp_model(**batch).loss
    loss.backward()
    ref_loss = reference_loss(ref, batch)
    ref_loss.backward()
    ref_grads = {n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
                 for n, p in ref.named_parameters() if p.requires_grad}
    diffs = {"loss": abs(loss.item() - ref_loss.item())}
    for name, (held, full) in adapter_pieces(tsp_model, ref_grads.get).items():
        if held.numel():
            diffs[name] = (held.grad - full).abs().max().item()
    return {"diffs": diffs, "adapters": len(ref_grads),
            "trainable": [n for n, p in tsp_model.named_parameters() if p.requires_grad],
            "frozen_grads": [n for n, p in tsp_model.named_parameters() if not p.requires_grad and p.grad is not None]}


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_lora_on_the_decoder_with_the_tower_frozen_matches_peft(run_ranks, tsp_size):
    from test_lora import check_lora
    check_lora(run_ranks(tsp_size, vlm_lora_parity, arch="qwen2_vl"), f"D={tsp_size} qwen2_vl LoRA")


def tower_held(arch):
    """``(tower parameters held on this rank, the tower's parameters in all, its units)``, the projector's
    included."""
    from ds_tsp.blocks.tower import ShardedUnit
    from ds_tsp.injection.policy import VISION_TOWERS, vision_family

    model = tiny_vlm(arch)

    def towers():
        return [model.get_submodule(path) for path in VISION_TOWERS[vision_family(model)]]

    total = sum(p.numel() for tower in towers() for p in tower.parameters())
    tsp_size = dist.get_world_size()
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    units = [m for tower in towers() for m in tower.modules() if isinstance(m, ShardedUnit)]
    return sum(p.numel() for tower in towers() for p in tower.parameters()), total, len(units)


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_each_rank_holds_a_dth_of_the_tower(run_ranks, tsp_size):
    for arch in ("qwen2_vl", "qwen3_vl", "gemma3"):
        per_rank = run_ranks(tsp_size, tower_held, arch=arch)
        held, total, units = per_rank[0]
        print(f"D={tsp_size} {arch}: {[rank[0] for rank in per_rank]} tower parameters a rank, of {total} "
              f"({units} units)")
        # A unit's slice is ceil(numel / D): at most one element of padding a unit past the 1/D share.
        assert units > 1 and all(rank[0] <= total / tsp_size + units for rank in per_rank)


def test_example_trains_a_vlm_under_the_deepspeed_launcher(tmp_path, own_processes):
    import json
    import os
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", "29519", os.path.join(root, "examples", "train_vlm.py"),
           "--deepspeed_config", os.path.join(root, "ds_configs", "tsp2_cpu.json"), "--steps", "30"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sizes = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{\"tsp\"")))
    print(sizes)
    # One rank holds half the tower (its units' slices, at most one element of padding each) and about half of
    # the decoder (its norms whole).
    held, whole = sizes["held per rank"], sizes["in all"]
    assert held["tower"] <= whole["tower"] / 2 + 8 and held["decoder"] < 0.6 * whole["decoder"]
    first, last = map(float, re.search(r"caption loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    print(f"caption loss {first} -> {last}")
    assert last < first - 1.0


def counted_vlm_step(arch, rows):
    """Bytes this rank receives per ``comm`` op in one training step of a tiny injected ``arch`` on ``rows``,
    with what the planner needs to predict them: the embedding's rows exchanged, the visual rows exchanged, the
    tower's units' sizes and the placeholders."""
    from ds_tsp.blocks import visual as visual_module
    from ds_tsp.blocks.tower import ShardedUnit
    from ds_tsp.parallel import comm, layout
    from ds_tsp.planning.communication import vocab_rows_per_rank

    D, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_vlm(arch)
    ds_tsp.inject(model, TSPTopology(D), TSPConfig(enabled=True, size=D, attention_backend="sdpa"))
    batch = visual_batch(rows, frames_apart=arch in FRAMES_APART, llava=arch == "llava", pixtral=arch == "mistral3",
                         gemma=arch == "gemma3")
    ids = layout.pad_to_multiple(batch["input_ids"], D, value=0)[0]
    owners = torch.stack([layout.shard(ids, j, D, "zigzag") for j in range(D)]).flatten(1) // \
        vocab_rows_per_rank(model.config.get_text_config().vocab_size, D)
    embedding_rows = (int((owners[rank] != rank).sum()), int((owners[torch.arange(D) != rank] == rank).sum()))
    routes = []
    original = visual_module.VisualRoute.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        routes.append(self)

    comm.counter.reset()
    with mock.patch.object(visual_module.VisualRoute, "__init__", recording):
        model(**batch).loss.backward()
    route = routes[0]
    visual_rows = (sum(route.recv_counts) - route.recv_counts[rank], sum(route.send_counts) - route.send_counts[rank])
    units = [m for m in model.modules() if isinstance(m, ShardedUnit)]
    return dict(counted={op: c["received"] for op, c in comm.counter.snapshot().items() if op != "barrier"},
                embedding_rows=embedding_rows, visual_rows=visual_rows, units=[unit.numel for unit in units],
                trained=[unit.numel for unit in units if unit.shard.grad is not None],
                seq_len=ids.shape[1], config=model.config.to_dict())


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_step_bytes_equal_the_planners_with_the_visual_rows_and_the_tower(run_ranks, tsp_size):
    """Every op's bytes of a training step, counted, equal the planner's: the text decoder's
    (``tsp_step_bytes_by_op``, with this batch's embedding rows) plus the tower's (``tsp_visual_bytes_by_op``:
    its units' all-gathers and reduce-scatters, the visual rows' all-to-all, with this batch's rows)."""
    from ds_tsp.planning.communication import tsp_step_bytes_by_op
    from ds_tsp.planning.visual import tsp_visual_bytes_by_op

    for arch in ("qwen2_vl", "qwen3_vl", "llava", "gemma3", "mistral3"):
        rows = ONE_IMAGE_EACH
        for rank, result in enumerate(run_ranks(tsp_size, counted_vlm_step, arch=arch, rows=rows)):
            config = result["config"]
            text = tsp_step_bytes_by_op(config, result["seq_len"], len(rows), tsp_size, 8, tsp_rank=rank,
                                        rows_exchanged=result["embedding_rows"])
            deepstack = len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ())
            visual = tsp_visual_bytes_by_op(result["units"], config["text_config"]["hidden_size"], 1, tsp_size, 8,
                                            features=1 + deepstack, rows_exchanged=result["visual_rows"],
                                            trained_numels=result["trained"])
            planned = {op: text.get(op, 0) + visual.get(op, 0) for op in {*text, *visual}}
            print(f"D={tsp_size} {arch} rank {rank}: counted {result['counted']}, planned {planned}")
            assert result["counted"] == planned


TRAINER_STEPS = 4


def _vision_rows(count, seed):
    """``count`` processor-style samples of one row each (a prompt, an image of one of two sizes, a caption)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        grid = (1, 4, 6) if index % 2 else (1, 4, 4)
        row = [("text", 3), ("image", grid), ("text", 28 - grid[1] * grid[2] // 4)]
        batch = visual_batch([row], seed=int(torch.randint(0, 1000, (1,), generator=generator)), dtype=torch.float32)
        samples.append({key: value[0] if key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
                        else value for key, value in batch.items()})
    return samples


def vision_collator(samples):
    """Rows stacked, every image's patches and grid concatenated in row order (as Qwen's processor does)."""
    rows = {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "attention_mask", "labels",
                                                                      "mm_token_type_ids")}
    return {**rows, "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
            "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples])}


def _vision_trainer_arguments(output_dir, per_device_batch, deepspeed=None):
    from transformers import TrainingArguments

    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device_batch,
                             max_steps=TRAINER_STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], seed=0,
                             disable_tqdm=True, save_strategy="no", remove_unused_columns=False, deepspeed=deepspeed,
                             **configured)


def tsp_vision_trainer_run(output_dir):
    """``ds_tsp.TSPTrainer`` on a tiny Qwen2-VL in float32 with a vision collator, TSP 2: its logged losses."""
    from accelerate.state import AcceleratorState

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    try:
        configure_cpu_ranks()
        config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                  "zero_optimization": {"stage": 1}, "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
        trainer = ds_tsp.TSPTrainer(model=tiny_vlm(dtype=torch.float32), data_collator=vision_collator,
                                    args=_vision_trainer_arguments(output_dir, 2, config),
                                    train_dataset=_vision_rows(2 * TRAINER_STEPS, 1))
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_tsp_trainer_with_a_vision_collator_matches_one_process(run_ranks, tmp_path):
    """The Trainer's logged losses under TSP 2 against the stock Trainer's in one process, the same run in float64
    the truth and the float32 one the control (tests/float32_control.py). Hugging Face's loss takes float32
    logits even from a float64 model, so the truth's losses are float32 values too and the bound is float32's
    rounding floor where the control matches them exactly."""
    from transformers import Trainer

    tsp = run_ranks(2, tsp_vision_trainer_run, output_dir=str(tmp_path / "tsp"), timeout_s=300)[0]
    stock = {}
    for dtype in (torch.float32, torch.float64):
        model = tiny_vlm(dtype=torch.float32).to(dtype)
        rows = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in row.items()}
                for row in _vision_rows(2 * TRAINER_STEPS, 1)]
        trainer = Trainer(model=model, data_collator=vision_collator, train_dataset=rows,
                          args=_vision_trainer_arguments(str(tmp_path / f"stock-{dtype}"), 2))
        trainer.train()
        stock[dtype] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    errors = relative_errors(tsp, stock[torch.float64])
    control = relative_errors(stock[torch.float32], stock[torch.float64])
    print(f"losses: TSP {tsp}, one process {stock[torch.float32]}, float64 {stock[torch.float64]}; "
          f"relative errors {max(errors):.1e}, the control's {max(control):.1e}")
    assert len(tsp) == TRAINER_STEPS and max(errors) <= float32_bound(control)


def converted_and_saved(source, converted, checkpoint):
    """``ds-tsp convert``'s shards of a VLM read back (the loss of the model read against the in-memory one's)
    and the engine's DeepSpeed checkpoint resumed at its layout (every parameter back), both in ``same``; what
    resharding that checkpoint answers; whether exporting it (model weights, and the fp32 master weights)
    gives Hugging Face's model, tower included, tensor for tensor."""
    from ds_tsp.checkpoint import CheckpointError, shard_checkpoint
    from ds_tsp.checkpoint.export import export_deepspeed_checkpoint
    from ds_tsp.checkpoint.resharding import reshard

    ref = tiny_vlm(dtype=torch.float32)
    if dist.get_rank() == 0:
        ref.save_pretrained(source)
        shard_checkpoint(source, converted, 2)
    dist.barrier()
    topo, config = TSPTopology(2), TSPConfig(enabled=True, size=2, attention_backend="sdpa")
    batch = visual_batch(ONE_IMAGE_EACH, dtype=torch.float32)
    model = ds_tsp.from_pretrained(converted, topo, config)
    in_memory = copy.deepcopy(ref)
    ds_tsp.inject(in_memory, topo, config)
    same_loss = model(**batch).loss.item() == in_memory(**batch).loss.item()
    engine, *_ = ds_tsp.initialize(model=copy.deepcopy(ref), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                   config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                                           "zero_allow_untested_optimizer": True,
                                           "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}})
    engine.save_checkpoint(checkpoint, tag="step0")
    saved = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    with torch.no_grad():
        for param in engine.module.parameters():
            param.zero_()
    engine.load_checkpoint(checkpoint, tag="step0")  # at its own layout
    same_loss = same_loss and all(torch.equal(param, saved[name]) for name, param in engine.module.named_parameters())
    refusals, exported = [], []
    if dist.get_rank() == 0:
        try:
            reshard(checkpoint, checkpoint + "-universal")
        except CheckpointError as refusal:
            refusals.append(str(refusal))
        for fp32_master in (False, True):
            export_deepspeed_checkpoint(checkpoint, source, checkpoint + "-hf", force=True, fp32_master=fp32_master)
            state = type(ref).from_pretrained(checkpoint + "-hf", dtype=torch.float32).state_dict()
            exported.append(sorted(state) == sorted(ref.state_dict())
                            and all(torch.equal(state[name], tensor) for name, tensor in ref.state_dict().items()))
    return same_loss, refusals, exported


def test_convert_and_export_read_back_and_resharding_a_vlm_checkpoint_is_refused(run_ranks, tmp_path):
    per_rank = run_ranks(2, converted_and_saved, source=str(tmp_path / "hf"), converted=str(tmp_path / "shards"),
                         checkpoint=str(tmp_path / "ds"))
    assert all(same_loss for same_loss, _, _ in per_rank)
    refusals, exported = per_rank[0][1:]
    print("\n".join(refusals))
    assert len(refusals) == 1 and "holds a vision-language model's tower" in refusals[0]
    assert exported == [True, True]  # the tower's slices joined into Hugging Face's tensors, both ways


def test_image_token_types_without_images_are_refused():
    """Gemma 3's token types marking image tokens with no pixels: Hugging Face would still let those tokens see each
    other, with no image in their place; token types of zeros (a text-only batch from its processor) pass."""
    from ds_tsp.injection.multimodal import _check_text_only
    with pytest.raises(ValueError, match="token_type_ids mark image tokens but no pixel_values were given"):
        _check_text_only({"token_type_ids": torch.tensor([[0, 1, 1, 0]])})
    _check_text_only({"token_type_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_visual_inputs_a_family_does_not_take_are_refused():
    from ds_tsp.injection.multimodal import LlavaVisualInputs
    with pytest.raises(ValueError, match=r"takes \['pixel_values'\] of the visual inputs, not \['pixel_values_videos'\]"):
        LlavaVisualInputs(tiny_vlm("llava"), {"pixel_values": None, "pixel_values_videos": torch.zeros(1)})
