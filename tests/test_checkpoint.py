"""Checkpoints: from_pretrained reads only a rank's shards; save_pretrained and
``ds-tsp convert`` give back the Hugging Face tensors bit for bit."""

import copy
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

import ds_tsp
from ds_tsp.checkpoint import CheckpointError, from_pretrained, save_pretrained
from ds_tsp.cli import main
from ds_tsp.config import TSPConfig
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel.topology import TSPTopology
from float32_control import float32_bound, relative_errors
from models import COMMON, PER_EXPERT_FILE_ARCHS, tiny_model
from parity import TOLERANCE, held_pieces, reference_loss
from scripts import start_script
from test_engine import ZERO3_PARTITIONED

# Tiny float64 models; COMMON has num_key_value_heads = 2, so at tsp.size 4
# two head groups share each key/value head (the nkv < D case).
# phi3: fused qkv_proj and gate_up_proj, each rank's shards read from and written
# back to their rows (ds_tsp.blocks.fused); gemma3: sandwich norms and per-head q/k norms; deepseek_v3_dense and
# deepseek_v2_lite: multi-head latent attention, down projections split by rows unevenly at 4; qwen3_next_dense: Gated
# DeltaNet layers, each rank's key heads a block of in_proj_qkvz / in_proj_ba and three pieces of conv1d's channels.
ARCHS = ("llama", "llama_tied", "qwen2", "qwen3", "gemma", "gemma3", "phi3", "deepseek_v3_dense",
         "deepseek_v2_lite", "qwen3_next_dense")


def hf_tensors(path):
    """Every tensor a Hugging Face checkpoint directory holds, by name."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(path, file)))
    return tensors


def assert_same_tensors(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name


def assert_same_sharded_checkpoint(actual, expected):
    """The same files, the same index text and the same tensors in each file,
    in a checkpoint of several weights files."""
    names = sorted(os.listdir(expected))
    assert len([name for name in names if name.endswith(".safetensors")]) > 2
    assert sorted(os.listdir(actual)) == names
    with open(os.path.join(expected, "model.safetensors.index.json")) as a, \
            open(os.path.join(actual, "model.safetensors.index.json")) as b:
        assert a.read() == b.read()
    for name in names:
        if name.endswith(".safetensors"):
            assert_same_tensors(load_file(os.path.join(actual, name)), load_file(os.path.join(expected, name)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{arch: path}`` of tiny float64 models saved by Hugging Face, plus a
    sharded (index.json) llama; paths are strings, ready for rank bodies."""
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for arch in ARCHS:
        paths[arch] = str(root / arch)
        tiny_model(arch).save_pretrained(paths[arch])
    paths["llama_sharded"] = str(root / "llama_sharded")
    tiny_model("llama").save_pretrained(paths["llama_sharded"], max_shard_size="8KB")
    assert os.path.isfile(os.path.join(paths["llama_sharded"], "model.safetensors.index.json"))
    return paths


def _topology_and_config(tsp_size=None):
    tsp_size = tsp_size or (dist.get_world_size() if dist.is_initialized() else 1)
    return TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa")


def _load_and_save(src, dst, corrupt_k_proj=False, tsp_size=None):
    topology, tsp_config = _topology_and_config(tsp_size)
    model = from_pretrained(src, topology, tsp_config)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.config.tie_word_embeddings
    if corrupt_k_proj and topology.tsp_rank == topology.tsp_size - 1:
        with torch.no_grad():
            model.model.layers[0].self_attn.spec.unpack(model.model.layers[0].self_attn.packed)["k_proj.weight"] += 1
    save_pretrained(model, dst)
    # Every rank returns only after rank 0 has written the files.
    return sorted(os.listdir(dst))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_then_save_pretrained_is_bit_exact(run_ranks, checkpoints, tmp_path, arch, tsp_size):
    dst = str(tmp_path / "saved")
    if tsp_size == 1:  # one process, no torch.distributed at all
        listings = [_load_and_save(checkpoints[arch], dst)]
    else:
        listings = run_ranks(tsp_size, _load_and_save, src=checkpoints[arch], dst=dst)
    assert all(files == ["config.json", "generation_config.json", "model.safetensors"] for files in listings)
    # The file holds exactly what Hugging Face's own save wrote (lm_head.weight
    # left out when tied), and Hugging Face loads it back to the same tensors.
    assert_same_tensors(hf_tensors(dst), hf_tensors(checkpoints[arch]))
    original = AutoModelForCausalLM.from_pretrained(checkpoints[arch])
    reloaded = AutoModelForCausalLM.from_pretrained(dst)
    assert type(reloaded) is type(original)
    assert_same_tensors(reloaded.state_dict(), original.state_dict())
    if arch == "llama_tied":
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def _train_step_and_save(src, dst, steps=1):
    """``from_pretrained``, ``steps`` SGD steps, ``save_pretrained``; then every tensor
    this rank holds (its pieces of the sharded ones, at their rows of Phi-3's
    fused tensors) against Hugging Face's load of the saved files. Returns the
    names that differ in any bit and those the steps left unchanged where Hugging Face's own steps changed them."""
    topology, tsp_config = _topology_and_config()
    model = from_pretrained(src, topology, tsp_config)
    batches = [torch.randint(0, COMMON["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(4 + step))
               for step in range(steps)]
    _sgd_steps(model, batches)
    save_pretrained(model, dst)
    original, saved = ({n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}
                       for path in (src, dst))
    differ = [name for name, _, held, full in held_pieces(model, saved) if not torch.equal(held, full)]
    # A frozen tensor (ERNIE 4.5-MoE's score-correction bias) is left as it was, and so is a piece Hugging Face's
    # own steps leave (PhiMoE's router with jitter 0, an expert no token chose).
    reference = AutoModelForCausalLM.from_pretrained(src, experts_implementation="eager")  # grouped_mm: no float64
    _sgd_steps(reference, batches)
    after_hf = held_pieces(model, {n: p.detach() for n, p in reference.named_parameters()})
    unchanged = [name for (name, param, held, before), (_, _, _, hf) in zip(held_pieces(model, original), after_hf)
                 if param.requires_grad and torch.equal(held, before) and not torch.equal(hf, before)]
    return differ, unchanged


def _sgd_steps(model, batches):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for input_ids in batches:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("arch, steps", [("phi3", 1), ("glm4", 1), ("ernie4_5_moe", 2), ("granitemoe", 2),
                                         ("cohere2", 1), ("cohere2_moe", 2), ("jais2", 1), ("helium", 1),
                                         ("ministral3", 1), ("hunyuan_v1_moe", 2), ("vaultgemma", 1), ("llama4", 2),
                                         ("phimoe", 2), ("cohere", 1), ("hyperclovax", 1), ("gemma4", 1),
                                         ("gemma4_moe", 2), ("gemma4_shared_kv", 1), ("gemma4_layer_inputs", 1),
                                         ("mixtral", 2), ("gpt_oss", 2), ("deepseek_v3", 2), ("deepseek_v32", 2),
                                         ("glm_moe_dsa", 2), ("qwen3_5", 2),
                                         ("bamba", 1), ("granitemoehybrid", 1), ("granitemoehybrid_moe", 2),
                                         ("nemotron_h", 2), ("lfm2_moe", 2), ("lfm3", 1), ("jamba", 2),
                                         ("falcon_h1", 1), ("falcon_h1_norm", 1)])
def test_trained_steps_save_bit_exact(run_ranks, tmp_path, arch, steps):
    """What training produced on every rank is what Hugging Face loads back,
    bit for bit: Phi-3's fused q/k/v and gate/up rows (GLM-4's gate/up under the auto policy, with its
    sandwich norms; ERNIE 4.5-MoE's experts and its score-correction bias, which its files hold beside the
    router; Granite-MoE's block_sparse_moe, its experts' files input_linear / output_linear; Jais-2's ungated
    MLP), Mixtral's experts
    (E, 2F, H) and GPT-OSS's (E, H, 2F) with their biases, its sinks and router,
    DeepSeek-V3's latent attention (down projections' rows uneven at 4) and experts, DeepSeek-V3.2's and
    GLM-MoE-DSA's lightning indexers (wq_b's and wk's rows a rank, the key norm and head weights whole),
    Qwen3.5's Gated DeltaNet (in_proj_qkv's and conv1d's three pieces a rank) and gated attention, Bamba's and
    Granite-4.0-H's Mamba-2 mixers (in_proj's five pieces a rank, conv1d's three), Granite-4.0-H's shared MLP
    (input_linear, output_linear) and its MoE block beside it, Nemotron-H's (backbone.* files, ungated per-expert
    files), LFM's short convolutions (in_proj's three pieces a rank), their attention's out_proj, w1/w3/w2 MLPs,
    LFM2-MoE's expert bias and LFM3's sandwich norms and head gates, Jamba's Mamba-1 mixers (x_proj split by
    columns) and MoE. (OLMo-Hybrid's and Kimi Linear's files read too, but Hugging Face keeps their A_log or dt_bias
    in float32 in this float64 model, so a float64 shard's cannot round trip to the bit:
    ``test_convolutions_in_parts_read``.)"""
    src = str(tmp_path / arch)
    tiny_model(arch).save_pretrained(src)
    for tsp_size in (2, 4):
        dst = str(tmp_path / f"trained-{tsp_size}")
        per_rank = run_ranks(tsp_size, _train_step_and_save, src=src, dst=dst, steps=steps)
        print(f"{arch} D={tsp_size}, {steps} steps: tensors differing from the saved files per rank "
              f"{[len(d) for d, _ in per_rank]} {per_rank[0][0][:4]}, left unchanged by the steps {[u for _, u in per_rank]}")
        assert all(not differ for differ, _ in per_rank)
        assert all(not unchanged for _, unchanged in per_rank)


def _load_from_parts(src, arch):
    """``from_pretrained`` of a checkpoint holding the convolution in three files (q_conv1d, k_conv1d, v_conv1d):
    ``(its loss, Hugging Face's own load's, the float64 model's)``. Both loads keep what the class keeps in float32
    (``_keep_in_fp32_modules_strict``: Kimi Linear's routers and, in Hugging Face's, its dt_bias), so neither is
    float64-exact: Hugging Face's is the control."""
    topology, tsp_config = _topology_and_config()
    model = from_pretrained(src, topology, tsp_config)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(4))
    loaded = AutoModelForCausalLM.from_pretrained(src, experts_implementation="eager")
    return tuple(loss.item() for loss in (model(input_ids=input_ids, labels=input_ids).loss,
                                          reference_loss(loaded, input_ids), reference_loss(tiny_model(arch), input_ids)))


@pytest.mark.parametrize("arch", ["olmo_hybrid", "kimi_linear"])
def test_convolutions_in_parts_read(run_ranks, tmp_path, arch):
    """OLMo-Hybrid's and Kimi Linear's files (each convolution in q/k/v_conv1d, Kimi's experts one file each and
    its forget gate's tensors beside it), read slice by slice at D = 2, give the float64 model's loss: exactly
    where the class keeps nothing in float32 (OLMo-Hybrid), else within the float32 control's bound (Hugging
    Face's own load of the files against the float64 model)."""
    src = str(tmp_path / arch)
    tiny_model(arch).save_pretrained(src)
    for loss, loaded, truth in run_ranks(2, _load_from_parts, src=src, arch=arch):
        ours, control = relative_errors([loss, loaded], [truth, truth])
        bound = TOLERANCE if control == 0 else float32_bound([control])
        print(f"{arch} from its files at D=2: relative |loss - the float64 model's| {ours:.2e} (Hugging Face's "
              f"load: {control:.2e}, bound {bound:.2e})")
        assert ours <= bound


def test_save_pretrained_with_data_parallel_replicas(run_ranks, checkpoints, tmp_path):
    """tsp.size 2 x dp 2: one TSP group gathers, global rank 0 writes, all wait."""
    dst = str(tmp_path / "saved")
    listings = run_ranks(4, _load_and_save, src=checkpoints["qwen2"], dst=dst, tsp_size=2)
    assert all(files == ["config.json", "generation_config.json", "model.safetensors"] for files in listings)
    assert_same_tensors(hf_tensors(dst), hf_tensors(checkpoints["qwen2"]))


def test_a_misplaced_or_wrong_shard_is_caught(run_ranks, checkpoints, tmp_path):
    """The guard: change rank 1's piece of one k_proj and only its rows differ."""
    dst = str(tmp_path / "saved")
    run_ranks(2, _load_and_save, src=checkpoints["llama"], dst=dst, corrupt_k_proj=True)
    saved, original = hf_tensors(dst), hf_tensors(checkpoints["llama"])
    name = "model.layers.0.self_attn.k_proj.weight"
    rows = original[name].shape[0] // 2
    assert torch.equal(saved[name][:rows], original[name][:rows])
    assert torch.equal(saved[name][rows:], original[name][rows:] + 1)
    assert all(torch.equal(saved[n], original[n]) for n in original if n != name)


def _losses(paths):
    topology, tsp_config = _topology_and_config()
    torch.manual_seed(3)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    losses = {}
    for arch, path in paths.items():
        loaded = from_pretrained(path, topology, tsp_config)
        in_memory = ds_tsp.inject(copy.deepcopy(AutoModelForCausalLM.from_pretrained(path)), topology, tsp_config)
        reference = AutoModelForCausalLM.from_pretrained(path)
        logits = reference(input_ids=input_ids).logits
        losses[arch] = (loaded(input_ids=input_ids, labels=input_ids).loss.item(),
                        in_memory(input_ids=input_ids, labels=input_ids).loss.item(),
                        F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten()).item())
    return losses


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_from_pretrained_gives_the_loss_of_in_memory_inject(run_ranks, checkpoints, tsp_size):
    per_rank = run_ranks(tsp_size, _losses, paths={arch: checkpoints[arch] for arch in ARCHS})
    for arch in ARCHS:
        loaded, in_memory, reference = per_rank[0][arch]
        print(f"{arch} D={tsp_size}: from_pretrained {loaded!r}, inject {in_memory!r}, HF {reference!r}")
        # Same tensors, same schedule: the same float64 operations in the same order.
        assert abs(loaded - in_memory) <= 1e-12
        assert abs(loaded - reference) <= 1e-10  # sharding reorders float64 sums only
        assert all(rank[arch] == per_rank[0][arch] for rank in per_rank)


def test_from_pretrained_reads_sharded_hugging_face_checkpoints(checkpoints, tmp_path):
    """The index.json layout of large checkpoints, in one process."""
    _load_and_save(checkpoints["llama_sharded"], str(tmp_path / "saved"))
    assert_same_tensors(hf_tensors(str(tmp_path / "saved")), hf_tensors(checkpoints["llama_sharded"]))


def test_torch_dtype_casts_every_tensor(checkpoints, tmp_path):
    topology, tsp_config = _topology_and_config()
    model = from_pretrained(checkpoints["qwen2"], topology, tsp_config, torch_dtype=torch.float32)
    assert {t.dtype for t in model.parameters()} == {torch.float32} and model.config.dtype == torch.float32
    save_pretrained(model, str(tmp_path / "saved"))
    expected = {name: t.float() for name, t in hf_tensors(checkpoints["qwen2"]).items()}
    assert_same_tensors(hf_tensors(str(tmp_path / "saved")), expected)


def _size_errors(paths):
    topology, tsp_config = _topology_and_config()
    messages = {}
    for key, path in paths.items():
        try:
            from_pretrained(path, topology, tsp_config)
        except ValueError as err:
            messages[key] = str(err)
    return messages


def _config_only(path, config):
    """A checkpoint directory with config.json and no weights: any read would fail."""
    config.save_pretrained(path)
    return str(path)


def test_size_errors_fire_before_any_tensor_is_read(run_ranks, tmp_path):
    paths = {
        "intermediate": _config_only(tmp_path / "f", LlamaConfig(**{**COMMON, "intermediate_size": 33})),
        "kv_heads": _config_only(tmp_path / "kv", LlamaConfig(**{**COMMON, "hidden_size": 24, "num_attention_heads": 6,
                                                                 "num_key_value_heads": 3})),
    }
    messages = run_ranks(2, _size_errors, paths=paths)[0]
    assert "intermediate_size 33 is not divisible by tsp.size 2" in messages["intermediate"]
    assert "num_key_value_heads = 3 is not divisible by tsp.size = 2" in messages["kv_heads"]


def test_policy_and_missing_tensors_are_refused_by_name(checkpoints, tmp_path):
    topology, tsp_config = _topology_and_config()
    # DiffLlama's attention holds its lambdas itself, which no TSP block carries.
    diff_llama = _config_only(tmp_path / "diffllama", DiffLlamaConfig(**COMMON, pad_token_id=0))
    with pytest.raises(PolicyError, match="DiffLlamaDecoderLayer"):
        from_pretrained(diff_llama, topology, tsp_config)

    broken = tmp_path / "broken"
    tiny_model("llama").save_pretrained(broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing .*broken"):
        from_pretrained(str(broken), topology, tsp_config)


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_then_join_is_bit_exact(checkpoints, tmp_path, arch, tsp_size):
    src, shards, joined = checkpoints[arch], str(tmp_path / "shards"), str(tmp_path / "joined")
    assert main(["convert", "--in", src, "--out", shards, "--tsp-size", str(tsp_size)]) == 0
    with open(os.path.join(shards, "tsp_shards.json")) as f:
        description = json.load(f)
    assert description["tsp_size"] == tsp_size
    original = hf_tensors(src)
    # Each rank's file holds exactly its pieces (key/value heads only on the
    # first rank of a replica set; a fused tensor's row pieces concatenated),
    # and the tensors outside the blocks whole.
    for rank in description["ranks"]:
        held = load_file(os.path.join(shards, rank["file"]))
        assert sorted(held) == sorted(rank["pieces"])
        for name, tensor in held.items():
            piece = rank["pieces"][name]
            if piece is None:
                expected = original[name]
            elif isinstance(piece[0], list):
                expected = torch.cat([original[name].narrow(*part) for part in piece])
            else:
                expected = original[name].narrow(*piece)
            assert torch.equal(tensor, expected), (name, rank["file"])
    assert set().union(*(rank["pieces"] for rank in description["ranks"])) == set(original)
    assert main(["convert", "--join", "--in", shards, "--out", joined]) == 0
    assert_same_tensors(hf_tensors(joined), original)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(src, name)) as a, open(os.path.join(joined, name)) as b:
            assert a.read() == b.read()


def test_a_pre_sharded_projection_under_another_name_loads(run_ranks, tmp_path):
    """Granite-4.0-H's shared MLP holds down_proj as output_linear, split by columns: ``ds-tsp convert`` writes
    each rank's columns and a TSP 2 load of them saves the original tensors back."""
    src, shards, dst = str(tmp_path / "granite"), str(tmp_path / "shards"), str(tmp_path / "saved")
    tiny_model("granitemoehybrid").save_pretrained(src)
    assert main(["convert", "--in", src, "--out", shards, "--tsp-size", "2"]) == 0
    run_ranks(2, _load_and_save, src=shards, dst=dst, tsp_size=2)
    assert_same_tensors(hf_tensors(dst), hf_tensors(src))


def test_a_pre_sharded_checkpoint_loads_on_its_tsp_size_only(run_ranks, checkpoints, tmp_path):
    shards, dst = str(tmp_path / "shards"), str(tmp_path / "saved")
    assert main(["convert", "--in", checkpoints["llama"], "--out", shards, "--tsp-size", "4"]) == 0
    run_ranks(4, _load_and_save, src=shards, dst=dst)
    assert_same_tensors(hf_tensors(dst), hf_tensors(checkpoints["llama"]))
    with pytest.raises(CheckpointError, match="pre-sharded for tsp.size = 4, not 1"):
        _load_and_save(shards, str(tmp_path / "never"))


def test_convert_refuses_unsupported_models_before_writing(tmp_path, capsys):
    src, out = tmp_path / "diffllama", tmp_path / "out"
    torch.manual_seed(0)
    DiffLlamaForCausalLM(DiffLlamaConfig(**COMMON, pad_token_id=0)).save_pretrained(src)
    assert main(["convert", "--in", str(src), "--out", str(out), "--tsp-size", "2"]) == 1
    assert "DiffLlamaDecoderLayer" in capsys.readouterr().err
    assert not out.exists()


def test_convert_refuses_a_non_empty_output_without_force(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank0-of-8.safetensors").write_text("stale")
    args = ["convert", "--in", checkpoints["llama"], "--out", str(out), "--tsp-size", "2"]
    assert main(args) == 1
    assert "not empty: pass --force" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["rank0-of-8.safetensors"]
    assert main(args + ["--force"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "rank0-of-2.safetensors",
                                       "rank1-of-2.safetensors", "tsp_shards.json"]
    assert main(["convert", "--in", str(out), "--out", str(out), "--join", "--force"]) == 1
    assert "is the input directory" in capsys.readouterr().err


# ----------------------------------------------------------------- memory

# Run in a fresh Python process per rank (argv: mode, path, tsp_size, tsp_rank,
# rendezvous file), so nothing an earlier test allocated can absorb the load.
# The peak is the kernel's resident-set high-water mark (VmHWM), reset to the
# current RSS by writing 5 to /proc/self/clear_refs just before loading, so it
# counts exactly what loading adds; where that file is not writable, the
# fallback is ru_maxrss, whose value before loading is then the imports' peak.
# Hugging Face maps safetensors files lazily, so every parameter is read once
# after loading (in both modes): the peak then includes the model's weights
# actually paged in, as using the model would.


def _measure(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return start_script([os.path.join(os.path.dirname(os.path.abspath(__file__)), "measure_from_pretrained.py"),
                         *args], env=env)


def _peak(script):
    proc = script.wait(timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_increase"]


def test_each_rank_loads_about_half_the_weights_at_tsp_size_2(tmp_path):
    """Per-rank peak RSS increase of ``from_pretrained`` at tsp.size 2 against
    Hugging Face's own ``from_pretrained`` of the whole model.

    ~270 MB of float32 in 64 thin Llama layers: building one TSP layer briefly
    holds about one layer's worth of extra memory (the pieces read, the packed
    copy), so many small layers keep that transient small next to the 1/2
    being measured, as the 32+ layers of real models do.
    """
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=64,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02, generator=generator)
    path = str(tmp_path / "llama-270mb")
    model.save_pretrained(path)
    del model
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    assert size >= 200e6

    # All three processes at once: each measures only its own memory.
    rendezvous = str(tmp_path / "rendezvous")
    procs = [_measure(["hf", path, 1, 0, rendezvous])] + [_measure(["tsp", path, 2, r, rendezvous]) for r in (0, 1)]
    full, *ranks = [_peak(proc) for proc in procs]
    ratio = max(ranks) / full
    print(f"\ncheckpoint {size / 1e6:.0f} MB; peak RSS increase: HF from_pretrained {full / 1e6:.0f} MB, "
          f"ds_tsp tsp.size 2 per rank {', '.join(f'{r / 1e6:.0f}' for r in ranks)} MB; ratio {ratio:.3f}")
    assert ratio <= 0.6


# ------------------------------------------------- shards, overwrite, choice

def _load_and_save_sharded(src, dst, max_shard_size, overwrite=False):
    topology, tsp_config = _topology_and_config()
    save_pretrained(from_pretrained(src, topology, tsp_config), dst, max_shard_size=max_shard_size,
                    overwrite=overwrite)
    return sorted(os.listdir(dst))


@pytest.mark.parametrize("max_shard_size", ["8KB", 8000])
def test_save_pretrained_writes_shards_and_index_as_hugging_face_does(run_ranks, checkpoints, tmp_path,
                                                                       max_shard_size):
    """The fixture's llama_sharded is Hugging Face's own save_pretrained(max_shard_size="8KB"):
    the same files, the same index text and the same tensors in each file."""
    src, dst = checkpoints["llama_sharded"], str(tmp_path / "saved")
    listings = run_ranks(2, _load_and_save_sharded, src=src, dst=dst, max_shard_size=max_shard_size)
    assert all(files == sorted(os.listdir(src)) for files in listings)
    assert_same_sharded_checkpoint(dst, src)
    reloaded = AutoModelForCausalLM.from_pretrained(dst)
    assert_same_tensors(reloaded.state_dict(), AutoModelForCausalLM.from_pretrained(src).state_dict())


def test_save_pretrained_holds_about_one_shard(checkpoints, tmp_path, monkeypatch):
    """The writer's tensors waiting for their file never exceed one file's limit
    plus one tensor (the model is ~40 KB, the limit 8 KB)."""
    from ds_tsp.checkpoint import writing

    held, add = [], writing.ShardWriter.add

    def counting_add(self, name, tensor):
        add(self, name, tensor)
        held.append(sum(t.nbytes for pending in self.pending.values() for t in pending.values()))

    monkeypatch.setattr(writing.ShardWriter, "add", counting_add)
    _load_and_save_sharded(checkpoints["llama"], str(tmp_path / "saved"), "8KB")
    total = sum(t.nbytes for t in hf_tensors(checkpoints["llama"]).values())
    largest = max(t.nbytes for t in hf_tensors(checkpoints["llama"]).values())
    print(f"model {total} B, most held by the writer {max(held)} B")
    assert len(held) == len(hf_tensors(checkpoints["llama"])) and max(held) <= 8000 + largest < total / 3


def _existing_checkpoints(root, checkpoints):
    """Directories each holding one kind of checkpoint, plus a tokenizer file that must survive."""
    kinds = {"single": "llama", "sharded": "llama_sharded"}
    dirs = {}
    for kind, arch in kinds.items():
        dirs[kind] = os.path.join(root, kind)
        shutil.copytree(checkpoints[arch], dirs[kind])
    dirs["bin"] = os.path.join(root, "bin")
    os.makedirs(dirs["bin"])
    torch.save(hf_tensors(checkpoints["llama"]), os.path.join(dirs["bin"], "pytorch_model.bin"))
    dirs["tsp_shards"] = os.path.join(root, "tsp_shards")
    assert main(["convert", "--in", checkpoints["llama"], "--out", dirs["tsp_shards"], "--tsp-size", "2"]) == 0
    for path in dirs.values():
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")
    return dirs


def test_save_pretrained_refuses_a_directory_holding_a_checkpoint(checkpoints, tmp_path):
    dirs = _existing_checkpoints(str(tmp_path), checkpoints)
    topology, tsp_config = _topology_and_config()
    model = from_pretrained(checkpoints["qwen2"], topology, tsp_config)
    for kind, path in dirs.items():
        before = sorted(os.listdir(path))
        with pytest.raises(CheckpointError, match=rf"{path} already holds a checkpoint .*pass overwrite=True"):
            save_pretrained(model, path)
        assert sorted(os.listdir(path)) == before, kind
        save_pretrained(model, path, overwrite=True)
        # Exactly one checkpoint: the stale weights, index, shards and TSP files are gone.
        assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors",
                                            "tokenizer.json"], kind
        assert_same_tensors(hf_tensors(path), hf_tensors(checkpoints["qwen2"]))
        assert isinstance(AutoModelForCausalLM.from_pretrained(path), type(tiny_model("qwen2")))


def _save_refused(dst):
    topology, tsp_config = _topology_and_config()
    model = ds_tsp.inject(tiny_model("llama"), topology, tsp_config)
    try:
        save_pretrained(model, dst)
    except CheckpointError as err:
        return str(err)
    return None


def test_every_rank_raises_the_refusal(run_ranks, checkpoints, tmp_path):
    """Rank 0 decides; every rank raises instead of waiting in a collective."""
    dst = str(tmp_path / "taken")
    shutil.copytree(checkpoints["llama"], dst)
    messages = run_ranks(2, _save_refused, dst=dst)
    assert all(message is not None and "overwrite=True" in message for message in messages)


def test_loading_prefers_the_file_hugging_face_prefers(checkpoints, tmp_path):
    """model.safetensors beside an index and its shards (and beside TSP shard
    files): both Hugging Face and ds_tsp read model.safetensors."""
    path = str(tmp_path / "both")
    shutil.copytree(checkpoints["llama_sharded"], path)
    tiny_model("llama", seed=1).save_pretrained(str(tmp_path / "other"))
    shutil.copyfile(str(tmp_path / "other" / "model.safetensors"), os.path.join(path, "model.safetensors"))
    topology, tsp_config = _topology_and_config()
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(hf.lm_head.weight, tiny_model("llama", seed=1).lm_head.weight)
    saved = str(tmp_path / "saved")
    save_pretrained(from_pretrained(path, topology, tsp_config), saved)
    assert_same_tensors(hf_tensors(saved), {n: t for n, t in hf.state_dict().items()})

    shards = str(tmp_path / "shards")
    assert main(["convert", "--in", checkpoints["llama"], "--out", shards, "--tsp-size", "1"]) == 0
    shutil.copyfile(str(tmp_path / "other" / "model.safetensors"), os.path.join(shards, "model.safetensors"))
    save_pretrained(from_pretrained(shards, topology, tsp_config), saved, overwrite=True)
    assert_same_tensors(hf_tensors(saved), hf_tensors(str(tmp_path / "other")))

    # An index comes before pytorch_model.bin in Hugging Face's order.
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save(hf.state_dict(), os.path.join(path, "pytorch_model.bin"))
    save_pretrained(from_pretrained(path, topology, tsp_config), saved, overwrite=True)
    assert_same_tensors(hf_tensors(saved), hf_tensors(checkpoints["llama_sharded"]))
    # pytorch_model.bin before TSP shard files, which Hugging Face does not read; ds_tsp reads no .bin.
    os.remove(os.path.join(shards, "model.safetensors"))
    torch.save(hf.state_dict(), os.path.join(shards, "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match="pytorch_model.bin, which Hugging Face loads before"):
        from_pretrained(shards, topology, tsp_config)


def test_bad_max_shard_size_is_refused_by_name(checkpoints, tmp_path):
    topology, tsp_config = _topology_and_config()
    model = from_pretrained(checkpoints["llama"], topology, tsp_config)
    for bad in ("5GiB", 0, "lots"):
        with pytest.raises(CheckpointError, match=rf"max_shard_size = {bad!r} is not a size"):
            save_pretrained(model, str(tmp_path / "never"), max_shard_size=bad)
    assert not (tmp_path / "never").exists()


# ------------------------------------ mixture of experts: per-expert files

def test_moe_experts_are_written_one_tensor_per_expert_as_transformers_writes_them(run_ranks, tmp_path):
    """transformers' save_pretrained writes a MoE model's experts one tensor per
    expert (its conversion mapping, reverted), and Hub checkpoints hold them so;
    save_pretrained (at tsp.size 2, from those files), write_state_dict (the
    writer of ds-tsp export) and convert --join write the same: the same files,
    index text and tensors, which Hugging Face loads back. convert's rank files
    hold each rank's piece of the fused tensors."""
    from ds_tsp.checkpoint.writing import write_state_dict

    for arch in PER_EXPERT_FILE_ARCHS:
        hf, hf_sharded = str(tmp_path / arch / "hf"), str(tmp_path / arch / "hf_sharded")
        source = tiny_model(arch)
        source.save_pretrained(hf)
        # The model as Hugging Face loads it (GLM-4.5's router in float32, as ds_tsp loads it too).
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64, experts_implementation="eager")
        ref.save_pretrained(hf_sharded, max_shard_size="8KB")
        saved, exported = str(tmp_path / arch / "saved"), str(tmp_path / arch / "exported")
        run_ranks(2, _load_and_save_sharded, src=hf, dst=saved, max_shard_size="8KB")
        write_state_dict(exported, ref.state_dict(), ref.config, max_shard_size="8KB")
        weights = sorted(name for name in os.listdir(hf_sharded) if "safetensors" in name)
        assert len(weights) > 3 and not any("gate_up_proj" in name for name in hf_tensors(hf_sharded))
        for out in (saved, exported):
            assert sorted(name for name in os.listdir(out) if "safetensors" in name) == weights, out
            with open(os.path.join(hf_sharded, "model.safetensors.index.json")) as a, \
                    open(os.path.join(out, "model.safetensors.index.json")) as b:
                assert a.read() == b.read(), out
            for name in weights[:-1]:  # the files, not the index
                assert_same_tensors(load_file(os.path.join(out, name)), load_file(os.path.join(hf_sharded, name)))
        assert_same_tensors(AutoModelForCausalLM.from_pretrained(saved).state_dict(), ref.state_dict())

        shards, joined = str(tmp_path / arch / "shards"), str(tmp_path / arch / "joined")
        assert main(["convert", "--in", hf, "--out", shards, "--tsp-size", "2"]) == 0
        with open(os.path.join(shards, "tsp_shards.json")) as f:
            ranks = json.load(f)["ranks"]
        full = source.state_dict()  # what the files hold: convert reads and writes them as they are
        for rank in ranks:
            for name, tensor in load_file(os.path.join(shards, rank["file"])).items():
                piece = rank["pieces"][name]
                assert torch.equal(tensor, full[name] if piece is None else full[name].narrow(*piece)), name
        assert main(["convert", "--join", "--in", shards, "--out", joined]) == 0
        assert_same_tensors(hf_tensors(joined), hf_tensors(hf))


def _bad_expert_files(root):
    """Qwen3-MoE files missing one expert's up projection, and files holding
    one layer's experts both fused and per expert."""
    ref = tiny_model("qwen3_moe")
    paths = {}
    for kind in ("missing", "both"):
        paths[kind] = os.path.join(root, kind)
        ref.save_pretrained(paths[kind])
        tensors = load_file(os.path.join(paths[kind], "model.safetensors"))
        if kind == "missing":
            del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
        else:
            tensors["model.layers.0.mlp.experts.down_proj"] = ref.model.layers[0].mlp.experts.down_proj.detach()
        save_file(tensors, os.path.join(paths[kind], "model.safetensors"), metadata={"format": "pt"})
    return paths


def test_incomplete_or_doubled_per_expert_files_are_refused_by_name(tmp_path):
    paths = _bad_expert_files(str(tmp_path))
    topology, tsp_config = _topology_and_config()
    with pytest.raises(CheckpointError, match=r"experts of model\.layers\.1\.mlp\.experts\.gate_up_proj one tensor "
                                              r"per expert, but not model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        from_pretrained(paths["missing"], topology, tsp_config)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj both fused and per expert"):
        from_pretrained(paths["both"], topology, tsp_config)


def test_up_read_as_gate_would_be_caught(tmp_path, monkeypatch):
    """The guard: with Mixtral's w3 (up) read as the gate, the experts loaded
    differ from the fused layout's, which the bit-for-bit comparisons check."""
    from ds_tsp.checkpoint import expert_files, reading

    ref = tiny_model("mixtral")
    ref.save_pretrained(str(tmp_path / "hf"))
    topology, tsp_config = _topology_and_config()
    right = from_pretrained(str(tmp_path / "hf"), topology, tsp_config).model.layers[0].mlp.packed
    assert torch.equal(right, ds_tsp.inject(copy.deepcopy(ref), topology, tsp_config).model.layers[0].mlp.packed)
    swapped = expert_files.ExpertFiles(((".block_sparse_moe.", ".mlp."),), {"gate_up_proj": ("w3", "w1"), "down_proj": ("w2",)})
    monkeypatch.setattr(reading, "expert_files", lambda config: swapped)
    wrong = from_pretrained(str(tmp_path / "hf"), topology, tsp_config).model.layers[0].mlp.packed
    assert not torch.equal(wrong, right)


# ------------------------------------------------------------ under ZeRO-3

def _zero3_save(src, dst, max_shard_size):
    """An engine whose every parameter (TSP shards, norms, vocabulary rows) ZeRO-3
    partitions over 2 data-parallel replicas, saved without a step taken."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **ZERO3_PARTITIONED},
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=src, config=config, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in engine.module.parameters())
    save_pretrained(engine, dst, max_shard_size=max_shard_size)
    # DeepSpeed's own export would write TSP shards under the model's names: refused, naming the call to use.
    with pytest.raises(NotImplementedError, match=r"ds_tsp\.save_pretrained\(engine, DIR\)"):
        engine.save_16bit_model(dst + "-16bit")
    # The partitions are released again once saved.
    return all(p.numel() == 0 for p in engine.module.parameters()) and not os.path.exists(dst + "-16bit")


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3"])
def test_zero3_saves_the_files_of_zero0(run_ranks, tmp_path, arch):
    """TSP 2 x DP 2 under ZeRO-3 writes what Hugging Face writes for the same weights
    (files, index text, tensors bit for bit): each block is gathered over the
    data-parallel group, then joined over TSP."""
    src, dst = str(tmp_path / "hf"), str(tmp_path / "saved")
    tiny_model(arch, dtype=torch.float32).save_pretrained(src, max_shard_size="8KB")
    assert run_ranks(4, _zero3_save, src=src, dst=dst, max_shard_size="8KB") == [True] * 4
    assert_same_sharded_checkpoint(dst, src)


# ------------------------------------------------------ a save that dies

@pytest.mark.parametrize("dying_rank", [0, 1])
def test_a_save_that_dies_leaves_the_old_checkpoint_whole(tmp_path, dying_rank):
    """The target holds a checkpoint of other weights and a tokenizer file; a
    rank dies inside save_pretrained (the writer after its second file, or its
    peer while blocks are gathered). The target is still the old checkpoint,
    file for file, and loads; the next save replaces the leftover and the old
    checkpoint with the new one and keeps the tokenizer file."""
    from ds_tsp.checkpoint.staging import leftovers

    target = tmp_path / "target"
    old = tiny_model("llama", seed=0, dtype=torch.float32)
    old.save_pretrained(target, max_shard_size="4KB")
    (target / "tokenizer.json").write_text("{}")
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}
    assert len([name for name in before if name.endswith(".safetensors")]) > 2

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_dies_while_saving.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = [start_script([script, rank, tmp_path / "rdzv", target, dying_rank], env=env) for rank in range(2)]
    procs = [s.wait(timeout=120) for s in started]
    assert procs[dying_rank].returncode == 3, procs[dying_rank].stdout + procs[dying_rank].stderr
    assert procs[1 - dying_rank].returncode != 0, procs[1 - dying_rank].stdout + procs[1 - dying_rank].stderr

    after = {name: (target / name).read_bytes() for name in os.listdir(target)}
    assert after == before
    assert_same_tensors(AutoModelForCausalLM.from_pretrained(target).state_dict(), old.state_dict())
    # The writer killed outright leaves its temporary directory beside the target, which nothing reads ...
    assert len(leftovers(target)) == (1 if dying_rank == 0 else 0)

    # ... and the next save removes.
    new = tiny_model("llama", seed=1, dtype=torch.float32)
    save_pretrained(ds_tsp.inject(copy.deepcopy(new), *_topology_and_config(1)), str(target), overwrite=True)
    assert leftovers(target) == []
    assert (target / "tokenizer.json").read_text() == "{}"
    assert_same_tensors(AutoModelForCausalLM.from_pretrained(target).state_dict(), new.state_dict())
