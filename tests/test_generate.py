"""TSP generation (prefill + incremental decoding) against Hugging Face, float64."""

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp import comm
from ds_tsp.config import TSPConfig
from ds_tsp.generate import TSPDecoder, generate
from ds_tsp.topology import TSPTopology
from ds_tsp.vocab import shard_rows
from models import COMMON, tiny_model

# float64 end to end: sharding and the log-sum-exp merge of partial attention
# only reorder sums (~1e-15); a wrong shard moves logits by ~1e-1 (guard test).
TOLERANCE = 1e-10
PROMPT_LEN = 14  # the layout pads it at D = 2, 4 (the cache drops the padding); 45 cached tokens split unevenly
NEW_TOKENS = 32


def _prompts(batch, seed=5):
    return torch.randint(0, COMMON["vocab_size"], (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _tsp_model(arch, tsp_size, wrong_shard=False):
    model = ds_tsp.inject(tiny_model(arch), TSPTopology(tsp_size),
                          TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    if wrong_shard and model.tsp_topology.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            model.model.layers[0].self_attn.packed.mul_(1.5)
    return model


def _run_generate(arch, input_ids, wrong_shard=False, measure_step=False, **kwargs):
    """On every rank: the generated sequences, per-step logits and cache size;
    with ``measure_step``, the bytes of one decode step by collective."""
    tsp_size = dist.get_world_size() if dist.is_initialized() else 1
    model = _tsp_model(arch, tsp_size, wrong_shard)
    out = generate(model, input_ids, return_dict_in_generate=True, **kwargs)
    result = {"sequences": out.sequences, "logits": torch.stack(out.logits, dim=1),
              "cache_bytes": out.cache.nbytes(), "cache_tokens": out.cache.length}
    if measure_step:
        decoder = TSPDecoder(model)
        lengths = torch.full((input_ids.shape[0],), input_ids.shape[1])
        logits = decoder.prefill(input_ids, lengths, num_decode_steps=1)
        comm.counter.reset()
        tokens = logits.argmax(dim=-1)
        decoder.step(tokens, lengths, decoder.targets[0])
        result["step_ops"] = comm.counter.snapshot()
        owned = (tokens // shard_rows(model.config.vocab_size, tsp_size) == model.tsp_topology.tsp_rank).sum()
        result["step_tokens_owned"] = int(owned)
    return result


def _hf_reference(arch, input_ids, attention_mask=None, max_new_tokens=NEW_TOKENS, **kwargs):
    """Hugging Face's generated tokens and float64 logits of every step.

    ``generate`` casts logits to float32, so the logits come from HF forwards
    on the generated prefixes instead (the full-sequence forward, no cache).
    """
    ref = tiny_model(arch)
    if attention_mask is None:  # without it HF would take token 0 (its pad id here) for padding
        attention_mask = torch.ones_like(input_ids)
    tokens = ref.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=kwargs.pop("pad_token_id", 0), **kwargs)
    prompt_len = input_ids.shape[1]
    with torch.no_grad():
        logits = [ref(input_ids=tokens[:, :prompt_len + s]).logits[:, -1] for s in range(tokens.shape[1] - prompt_len)]
    return tokens, torch.stack(logits, dim=1)


def _max_logit_diff(per_rank, ref_logits):
    return max((r["logits"] - ref_logits).abs().max().item() for r in per_rank)


def _kv_bytes_per_token(batch):
    return COMMON["num_hidden_layers"] * 2 * batch * COMMON["num_key_value_heads"] * COMMON["head_dim"] * 8


def _decode_step_bytes(tsp_size, batch, tokens_owned):
    """The module docstring's formula, float64 (e = a = 8 bytes): ``(received, sent)``
    by a rank that owns the embedding rows of ``tokens_owned`` of the new tokens."""
    hq = COMMON["num_attention_heads"] // tsp_size
    hkv = max(COMMON["num_key_value_heads"] // tsp_size, 1)
    d, hidden = COMMON["head_dim"], COMMON["hidden_size"]
    per_layer = (tsp_size - 1) * batch * ((hq + 2 * hkv) * d + hq * (d + 1) + 2 * hidden) * 8
    logits = (tsp_size - 1) * batch * shard_rows(COMMON["vocab_size"], tsp_size) * 8
    if tsp_size == 1:
        return 0, 0
    blocks = COMMON["num_hidden_layers"] * per_layer + logits
    return blocks + (batch - tokens_owned) * hidden * 8, blocks + (tsp_size - 1) * tokens_owned * hidden * 8


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_greedy_tokens_logits_cache_and_bytes_match(run_ranks, tsp_size):
    batch = 2
    prompts = _prompts(batch)
    tokens_cached = PROMPT_LEN + NEW_TOKENS - 1  # the last token is never fed back
    single_device = _run_generate("llama", prompts, max_new_tokens=NEW_TOKENS)["cache_bytes"]
    assert single_device == tokens_cached * _kv_bytes_per_token(batch)
    # D = 1 runs in this process (no process group), sparing a rank pool's start-up.
    run = run_ranks if tsp_size > 1 else (lambda _, body, **kwargs: [body(**kwargs)])
    for arch in ("llama", "qwen2", "qwen3"):
        ref_tokens, ref_logits = _hf_reference(arch, prompts)
        per_rank = run(tsp_size, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=NEW_TOKENS,
                       measure_step=True, pad_token_id=0)
        diff = _max_logit_diff(per_rank, ref_logits)
        cache = [r["cache_bytes"] for r in per_rank]
        print(f"D={tsp_size} {arch}: max|logit diff| {diff:.2e}; KV cache bytes per rank {cache} "
              f"(single device {single_device}, /D = {single_device / tsp_size:.0f}); decode step received "
              f"{sum(op['received'] for op in per_rank[0]['step_ops'].values())} B/rank")
        for r in per_rank:
            assert torch.equal(r["sequences"], ref_tokens)
            assert torch.equal(r["logits"], per_rank[0]["logits"])  # bit-identical on every rank
        assert diff <= TOLERANCE
        # 1/D of the single-device cache, up to one token of imbalance (same in every layer).
        assert sum(cache) == single_device
        assert all(abs(c - single_device / tsp_size) < _kv_bytes_per_token(batch) for c in cache)
        # Weights never move while decoding: only the activations (and the new
        # tokens' embedding rows and logits slices) of the formula.
        for r in per_rank:
            ops = r["step_ops"]
            assert set(ops) <= {"all_gather", "all_to_all"}
            received, sent = _decode_step_bytes(tsp_size, batch, r["step_tokens_owned"])
            assert sum(op["received"] for op in ops.values()) == received
            assert sum(op["sent"] for op in ops.values()) == sent


def test_mistral_sliding_window_at_four_ranks(run_ranks):
    prompts = _prompts(1, seed=8)
    ref_tokens, ref_logits = _hf_reference("mistral", prompts, max_new_tokens=12)
    per_rank = run_ranks(4, _run_generate, arch="mistral", input_ids=prompts, max_new_tokens=12)
    diff = _max_logit_diff(per_rank, ref_logits)
    print(f"D=4 mistral (window 5): max|logit diff| {diff:.2e}")
    assert all(torch.equal(r["sequences"], ref_tokens) for r in per_rank)
    assert diff <= TOLERANCE


def test_mixture_of_experts_generates_as_hugging_face(run_ranks):
    """Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE at D=2: each rank
    decodes with its own experts only; tokens equal HF's cached generate."""
    prompts = _prompts(2, seed=9)
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        ref_tokens, ref_logits = _hf_reference(arch, prompts, max_new_tokens=8)
        per_rank = run_ranks(2, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=8)
        diff = _max_logit_diff(per_rank, ref_logits)
        print(f"D=2 {arch}: max|logit diff| {diff:.2e}")
        assert all(torch.equal(r["sequences"], ref_tokens) for r in per_rank)
        assert diff <= TOLERANCE


# Dynamic RoPE rescales from the largest position id, here past max_position_embeddings
# already in the prompt, and again at every decode step.
DYNAMIC_ROPE = {"max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}


def _generate_dynamic_rope(input_ids, max_new_tokens):
    tsp_size = dist.get_world_size()
    model = ds_tsp.inject(tiny_model("llama", **DYNAMIC_ROPE), TSPTopology(tsp_size),
                          TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    out = generate(model, input_ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_dynamic_rope_generates_as_hugging_face(run_ranks, tsp_size):
    """Against HF's own cached generation: with dynamic RoPE its cached keys keep
    the frequencies they were rotated with, so no-cache forwards are not the
    reference here. HF returns these logits in float32: the bound is float32
    rounding of logits of magnitude ~10 (per-rank rotary tables in the prefill move them by ~5)."""
    prompts = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    ref = tiny_model("llama", **DYNAMIC_ROPE)
    hf = ref.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=8,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf_logits = torch.stack(hf.logits, dim=1).double()
    per_rank = run_ranks(tsp_size, _generate_dynamic_rope, input_ids=prompts, max_new_tokens=8)
    diff = max((logits.double() - hf_logits).abs().max().item() for _, logits in per_rank)
    print(f"D={tsp_size} dynamic RoPE: max|logit diff| against HF's float32 logits {diff:.2e}")
    assert all(torch.equal(sequences, hf.sequences) for sequences, _ in per_rank)
    assert diff <= 1e-5


def test_a_wrong_shard_is_caught(run_ranks):
    prompts = _prompts(1)
    _, ref_logits = _hf_reference("llama", prompts, max_new_tokens=4)
    per_rank = run_ranks(2, _run_generate, arch="llama", input_ids=prompts, max_new_tokens=4, wrong_shard=True)
    diff = _max_logit_diff(per_rank, ref_logits)
    print(f"wrong shard: max|logit diff| {diff:.2e}")
    assert diff > 1e3 * TOLERANCE


def _left_padded_batch():
    lengths = [13, 6, 9]
    prompts = _prompts(len(lengths), seed=11)
    mask = torch.zeros_like(prompts)
    for row, length in enumerate(lengths):
        mask[row, PROMPT_LEN - length:] = 1
    return prompts.masked_fill(mask == 0, 0), mask, lengths


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_left_padded_batch_matches_each_prompt_alone(run_ranks, tsp_size):
    prompts, mask, lengths = _left_padded_batch()
    per_rank = run_ranks(tsp_size, _run_generate, arch="qwen2", input_ids=prompts, attention_mask=mask,
                         max_new_tokens=16)
    batched_hf, _ = _hf_reference("qwen2", prompts, attention_mask=mask, max_new_tokens=16)
    worst = 0.0
    for row, length in enumerate(lengths):
        alone = prompts[row:row + 1, PROMPT_LEN - length:]
        ref_tokens, ref_logits = _hf_reference("qwen2", alone, max_new_tokens=16)
        for r in per_rank:
            assert torch.equal(r["sequences"][row, PROMPT_LEN:], ref_tokens[0, length:])
            worst = max(worst, (r["logits"][row] - ref_logits[0]).abs().max().item())
    print(f"D={tsp_size} left-padded batch {lengths}: max|logit diff| vs each prompt alone {worst:.2e}")
    assert worst <= TOLERANCE
    assert all(torch.equal(r["sequences"], batched_hf) for r in per_rank)
    assert all(torch.equal(r["sequences"][:, :PROMPT_LEN], prompts) for r in per_rank)


def test_right_padding_and_holes_are_refused():
    model = _tsp_model("llama", 1)
    ids = torch.zeros(2, 6, dtype=torch.long)
    for mask in ([[1, 1, 1, 1, 0, 0], [1] * 6], [[0, 1, 1, 0, 1, 1], [1] * 6]):
        with pytest.raises(ValueError, match="attention_mask must be left padding"):
            generate(model, ids, 4, attention_mask=torch.tensor(mask))
    with pytest.raises(ValueError, match="at least one real token"):
        generate(model, ids, 4, attention_mask=torch.tensor([[0] * 6, [1] * 6]))
    with pytest.raises(TypeError, match="not a TSP model"):
        generate(tiny_model("llama"), ids, 4)


def _sample_with_seeds(arch):
    prompts = _prompts(2)
    model = _tsp_model(arch, dist.get_world_size())
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=10)
    runs = {"seed_7": 7, "seed_7_again": 7, "seed_8": 8, "no_seed": None}
    return {name: generate(model, prompts, seed=seed, **kwargs) for name, seed in runs.items()}


def test_sampling_is_identical_on_every_rank_and_reproducible(run_ranks):
    per_rank = run_ranks(2, _sample_with_seeds, arch="llama")
    for key in per_rank[0]:
        assert all(torch.equal(r[key], per_rank[0][key]) for r in per_rank), key
    first = per_rank[0]
    assert torch.equal(first["seed_7"], first["seed_7_again"])
    assert not torch.equal(first["seed_7"], first["seed_8"])
    # The same seed at D=1 draws the same tokens: the logits agree to ~1e-15.
    single = generate(_tsp_model("llama", 1), _prompts(2), 20, do_sample=True, temperature=0.8, top_k=10, seed=7)
    assert torch.equal(single, first["seed_7"])
    # top_k = 1 is greedy.
    greedy = generate(_tsp_model("llama", 1), _prompts(2), 20)
    assert torch.equal(generate(_tsp_model("llama", 1), _prompts(2), 20, do_sample=True, top_k=1, seed=3), greedy)


def _early_eos(tokens):
    """The token that ends both rows soonest (HF's greedy rows ``tokens``)."""
    first = {}
    for token in set(tokens[0].tolist()) & set(tokens[1].tolist()):
        first[token] = max(row.tolist().index(token) for row in tokens)
    return min(first, key=first.get)


def test_eos_stops_when_every_sequence_is_done(run_ranks):
    prompts = _prompts(2, seed=21)
    free_run, _ = _hf_reference("llama", prompts)
    eos = _early_eos(free_run[:, PROMPT_LEN:])
    hf_tokens, _ = _hf_reference("llama", prompts, eos_token_id=eos, pad_token_id=eos)
    per_rank = run_ranks(2, _run_generate, arch="llama", input_ids=prompts, max_new_tokens=NEW_TOKENS,
                         eos_token_id=eos)
    print(f"EOS {eos}: stopped after {hf_tokens.shape[1] - PROMPT_LEN} of {NEW_TOKENS} tokens")
    assert hf_tokens.shape[1] < PROMPT_LEN + NEW_TOKENS
    assert all(torch.equal(r["sequences"], hf_tokens) for r in per_rank)
    assert (hf_tokens[:, -1] == eos).all()


def test_hugging_face_generate_names_the_ds_tsp_call():
    """Hugging Face's model.generate needs a KV cache the TSP training forward does
    not build: the refusal names ds_tsp.generate.generate."""
    model = _tsp_model("llama", 1)
    with pytest.raises(ValueError, match=r"ds_tsp\.generate\.generate\(model, input_ids, max_new_tokens"):
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2)
