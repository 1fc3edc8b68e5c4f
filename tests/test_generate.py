"""Hugging Face's model.generate on a TSP model (prefill + decoding from the
sequence-sharded cache) against model.generate on the unsharded model, float64."""

import pytest
import torch
import torch.distributed as dist
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

import ds_tsp
from ds_tsp.parallel import comm
from ds_tsp.config import TSPConfig
from ds_tsp.inference.generate import cached_forward
from ds_tsp.inference.kv_cache import TSPCache
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.blocks.vocab import shard_rows
from float32_control import UNIT_ROUNDOFF
from models import COMMON, tiny_model

# float64 end to end: sharding and the log-sum-exp merge of partial attention
# only reorder sums (~1e-15); a wrong shard moves logits by ~1e-1 (guard test).
TOLERANCE = 1e-10
PROMPT_LEN = 14  # the layout pads it at D = 2, 4 (the cache drops the padding); 45 cached tokens split unevenly
NEW_TOKENS = 32


def _prompts(batch, seed=5):
    return torch.randint(0, COMMON["vocab_size"], (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _left_padded(lengths, seed=11):
    """Prompts of ``lengths`` real tokens, LEFT padded with token 0 to ``PROMPT_LEN``, and their mask."""
    prompts = _prompts(len(lengths), seed)
    mask = torch.zeros_like(prompts)
    for row, length in enumerate(lengths):
        mask[row, PROMPT_LEN - length:] = 1
    return prompts.masked_fill(mask == 0, 0), mask


def _tsp_model(arch, tsp_size, wrong_shard=False, vocab_parallel=True, **overrides):
    model = ds_tsp.inject(tiny_model(arch, **overrides), TSPTopology(tsp_size),
                          TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa",
                                    vocab_parallel=vocab_parallel))
    if wrong_shard and model.tsp_topology.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            model.model.layers[0].self_attn.packed.mul_(1.5)
    return model


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def _generate_recording_logits(model, input_ids, **kwargs):
    """``model.generate`` and the float64 logits of each step (``generate``
    itself hands its logits processors float32 copies)."""
    logits = []
    hook = model.register_forward_hook(lambda module, args, output: logits.append(output.logits[:, -1]))
    try:
        out = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
    finally:
        hook.remove()
    return out, torch.stack(logits, dim=1)


def _run_generate(arch, input_ids, wrong_shard=False, measure_step=False, vocab_parallel=True, **kwargs):
    """On every rank: the generated sequences, per-step logits and cache size;
    with ``measure_step``, the bytes of one decode step by collective."""
    model = _tsp_model(arch, _world_size(), wrong_shard, vocab_parallel)
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    out, logits = _generate_recording_logits(model, input_ids, pad_token_id=0, **kwargs)
    result = {"sequences": out.sequences, "logits": logits, "cache_bytes": out.cache.nbytes(),
              "cache_tokens": out.cache.length}
    if measure_step:
        step_logits, cache = cached_forward(model, input_ids, logits_to_keep=1)
        comm.counter.reset()
        cached_forward(model, step_logits.argmax(dim=-1), cache=cache, logits_to_keep=1)
        result["step_ops"] = comm.counter.snapshot()
    return result


def _hf_reference(arch, input_ids, attention_mask=None, max_new_tokens=NEW_TOKENS, **kwargs):
    """Hugging Face's generated tokens and float64 logits of every step."""
    ref = tiny_model(arch)
    if attention_mask is None:  # without it HF would take token 0 (its pad id here) for padding
        attention_mask = torch.ones_like(input_ids)
    out, logits = _generate_recording_logits(ref, input_ids, attention_mask=attention_mask,
                                             max_new_tokens=max_new_tokens,
                                             pad_token_id=kwargs.pop("pad_token_id", 0), **kwargs)
    return out.sequences, logits


def _max_logit_diff(per_rank, ref_logits):
    return max((r["logits"] - ref_logits).abs().max().item() for r in per_rank)


def _kv_bytes_per_token(batch):
    return COMMON["num_hidden_layers"] * 2 * batch * COMMON["num_key_value_heads"] * COMMON["head_dim"] * 8


def _decode_step_bytes(tsp_size, batch):
    """The module docstring's formula, float64 (e = a = 8 bytes): bytes received (= sent) per rank."""
    hq = COMMON["num_attention_heads"] // tsp_size
    hkv = max(COMMON["num_key_value_heads"] // tsp_size, 1)
    d, hidden = COMMON["head_dim"], COMMON["hidden_size"]
    per_layer = (tsp_size - 1) * batch * ((hq + 2 * hkv) * d + hq * (d + 1) + 2 * hidden) * 8
    logits = (tsp_size - 1) * batch * shard_rows(COMMON["vocab_size"], tsp_size) * 8
    embedding = (tsp_size - 1) * batch * hidden * 8
    return COMMON["num_hidden_layers"] * per_layer + logits + embedding


def _in_process(_, body, **kwargs):
    """D = 1 runs in this process (no process group), sparing a rank pool's start-up."""
    return [body(**kwargs)]


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_greedy_tokens_logits_cache_and_bytes_match(run_ranks, tsp_size):
    batch = 2
    prompts = _prompts(batch)
    tokens_cached = PROMPT_LEN + NEW_TOKENS - 1  # the last token is never fed back
    single_device = _run_generate("llama", prompts, max_new_tokens=NEW_TOKENS)["cache_bytes"]
    assert single_device == tokens_cached * _kv_bytes_per_token(batch)
    run = run_ranks if tsp_size > 1 else _in_process
    for arch in ("llama", "qwen2"):  # Qwen3's q/k norms: test_a_cached_forward_returns_the_cache_as_hugging_face
        ref_tokens, ref_logits = _hf_reference(arch, prompts)
        per_rank = run(tsp_size, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=NEW_TOKENS,
                       measure_step=True)
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
            expected = _decode_step_bytes(tsp_size, batch)
            assert sum(op["received"] for op in ops.values()) == expected
            assert sum(op["sent"] for op in ops.values()) == expected


# Decoding strategies Hugging Face's loop runs on the TSP logits, each against
# the same strategy on the unsharded model.
STRATEGIES = {"greedy": {}, "beams_2": {"num_beams": 2}, "beams_4": {"num_beams": 4, "num_return_sequences": 2},
              "repetition_penalty": {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}}
LEFT_PADDED_LENGTHS = [13, 6, 9]
# Hugging Face's Mixtral computes its load-balancing loss in generate too when
# the config asks for router logits, and fails there on a padded mask.
_NO_ROUTER_LOSS = {"mixtral": {"output_router_logits": False}}


def _run_strategies(arch, input_ids, attention_mask, max_new_tokens):
    model = _tsp_model(arch, _world_size(), **_NO_ROUTER_LOSS.get(arch, {}))
    return {name: model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=0, **kwargs) for name, kwargs in STRATEGIES.items()}


def check_recurrent_generation(run_ranks, arch, tsp_sizes=(2,)):
    """A hybrid's generation at each of ``tsp_sizes``: greedy tokens and every step's logits against Hugging
    Face's; then greedy, beam search and penalties on left-padded prompts at D = 2."""
    prompts = _prompts(2, seed=9)
    ref_tokens, ref_logits = _hf_reference(arch, prompts, max_new_tokens=8)
    for tsp_size in tsp_sizes:
        per_rank = run_ranks(tsp_size, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=8)
        diff = _max_logit_diff(per_rank, ref_logits)
        print(f"D={tsp_size} {arch}: max|logit diff| {diff:.2e}; cache {[r['cache_bytes'] for r in per_rank]} B")
        assert all(torch.equal(r["sequences"], ref_tokens) for r in per_rank)
        assert diff <= TOLERANCE
    check_strategies_on_left_padded_prompts(run_ranks, arch)


def check_strategies_on_left_padded_prompts(run_ranks, arch, tsp_size=2):
    """Greedy, beam search and penalties on prompts of ``LEFT_PADDED_LENGTHS``:
    Hugging Face's tokens on every rank; returns Hugging Face's."""
    prompts, mask = _left_padded(LEFT_PADDED_LENGTHS)
    ref = tiny_model(arch, **_NO_ROUTER_LOSS.get(arch, {}))
    expected = {name: ref.generate(prompts, attention_mask=mask, max_new_tokens=10, pad_token_id=0, **kwargs)
                for name, kwargs in STRATEGIES.items()}
    per_rank = run_ranks(tsp_size, _run_strategies, arch=arch, input_ids=prompts, attention_mask=mask,
                         max_new_tokens=10)
    for name in STRATEGIES:
        print(f"D={tsp_size} {arch} {name}: {tuple(expected[name].shape)} tokens equal HF's")
        assert all(torch.equal(r[name], expected[name]) for r in per_rank), (arch, name)
    return expected


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_decoding_strategies_give_hugging_face_tokens(run_ranks, tsp_size):
    """Greedy, beam search (2 and 4 beams: the sharded cache is reordered on
    every rank) and repetition / no-repeat-ngram penalties, on left-padded
    prompts of different lengths; sliding-window Mistral and Mixtral (MoE)
    included."""
    for arch in ("llama", "qwen3", "mistral", "mixtral"):
        expected = check_strategies_on_left_padded_prompts(run_ranks, arch, tsp_size)
        assert not torch.equal(expected["greedy"], expected["repetition_penalty"])  # the penalty changed tokens


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_left_padded_batch_matches_each_prompt_alone(run_ranks, vocab_parallel):
    """The folded vocabulary (embedding rows and logits from their owners) and the replicated one."""
    prompts, mask = _left_padded(LEFT_PADDED_LENGTHS)
    per_rank = run_ranks(4, _run_generate, arch="qwen2", input_ids=prompts, attention_mask=mask,
                         max_new_tokens=16, vocab_parallel=vocab_parallel)
    worst = 0.0
    for row, length in enumerate(LEFT_PADDED_LENGTHS):
        alone = prompts[row:row + 1, PROMPT_LEN - length:]
        ref_tokens, ref_logits = _hf_reference("qwen2", alone, max_new_tokens=16)
        for r in per_rank:
            assert torch.equal(r["sequences"][row, PROMPT_LEN:], ref_tokens[0, length:])
            worst = max(worst, (r["logits"][row] - ref_logits[0]).abs().max().item())
    print(f"D=4 left-padded batch {LEFT_PADDED_LENGTHS}, vocab_parallel {vocab_parallel}: max|logit diff| vs "
          f"each prompt alone {worst:.2e}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss", "phi3", "phi4_mini"])
def test_experts_and_fused_projections_generate_as_hugging_face(run_ranks, arch):
    """At D=2: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and GLM-4.5
    (sigmoid router with its score-correction bias, ungated shared expert, a
    dense first layer, half of each head rotary), GPT-OSS (attention sinks on
    sliding and full layers, biased clamped experts), each rank decoding with
    its own experts only; Phi-3 (fused qkv_proj, gate_up_proj)
    and the Phi-4-mini shape (3/4 of each head rotary under longrope): past
    original_max_position_embeddings (16) Phi-3's generate drops the cache and
    prefills again with longrope's long factors, on the TSP model as on
    Hugging Face's."""
    prompts = _prompts(2, seed=9)
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
    model = _tsp_model("llama", dist.get_world_size(), **DYNAMIC_ROPE)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)


def test_dynamic_rope_generates_as_hugging_face(run_ranks):
    """Hugging Face's cached keys keep the frequencies they were rotated with,
    as the TSP cache's do. ``output_logits`` are float32: each side's float64
    logits (within TOLERANCE of each other) rounded to float32 once, each off
    its float64 value by at most u |logit| (round to nearest, u = 2^-24), so the
    bound is TOLERANCE + 2 u max|logit| (+ TOLERANCE on that max), on any
    machine."""
    prompts = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    ref = tiny_model("llama", **DYNAMIC_ROPE)
    hf = ref.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=8,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf_logits = torch.stack(hf.logits, dim=1).double()
    per_rank = run_ranks(4, _generate_dynamic_rope, input_ids=prompts, max_new_tokens=8)
    diff = max((logits.double() - hf_logits).abs().max().item() for _, logits in per_rank)
    bound = TOLERANCE + 2 * UNIT_ROUNDOFF * (hf_logits.abs().max().item() + TOLERANCE)
    print(f"D=4 dynamic RoPE: max|logit diff| against HF's float32 logits {diff:.2e} (bound {bound:.2e})")
    assert all(torch.equal(sequences, hf.sequences) for sequences, _ in per_rank)
    assert diff <= bound


def test_a_wrong_shard_is_caught(run_ranks):
    prompts = _prompts(1)
    _, ref_logits = _hf_reference("llama", prompts, max_new_tokens=4)
    per_rank = run_ranks(2, _run_generate, arch="llama", input_ids=prompts, max_new_tokens=4, wrong_shard=True)
    diff = _max_logit_diff(per_rank, ref_logits)
    print(f"wrong shard: max|logit diff| {diff:.2e}")
    assert diff > 1e3 * TOLERANCE


SAMPLING = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                pad_token_id=0)


def _sample(seed_per_rank):
    """Sampled sequences under seeds 7, 7 again and 8; ``seed_per_rank`` seeds
    each rank differently for a fourth run."""
    model = _tsp_model("llama", dist.get_world_size())
    prompts = _prompts(2)
    runs = {}
    for name, seed in (("seed_7", 7), ("seed_7_again", 7), ("seed_8", 8)):
        torch.manual_seed(seed)
        runs[name] = model.generate(prompts, attention_mask=torch.ones_like(prompts), **SAMPLING)
    torch.manual_seed(seed_per_rank + dist.get_rank())
    runs["seeds_differ"] = model.generate(prompts, attention_mask=torch.ones_like(prompts), **SAMPLING)
    return runs


def test_sampling_is_identical_on_every_rank_and_equals_hugging_face(run_ranks):
    """Temperature, top-k, top-p and min-p: on one process Hugging Face's
    sampling is reproducible under a seed (CPU), and TSP draws the same tokens
    from the same seed, since its logits agree to ~1e-15 and are float32 when
    sampled. Ranks seeded differently still agree: the prefill hands every
    rank TSP rank 0's random state."""
    per_rank = run_ranks(2, _sample, seed_per_rank=100)
    for key in per_rank[0]:
        assert all(torch.equal(r[key], per_rank[0][key]) for r in per_rank), key
    first = per_rank[0]
    assert torch.equal(first["seed_7"], first["seed_7_again"])
    assert not torch.equal(first["seed_7"], first["seed_8"])
    ref = tiny_model("llama")
    prompts = _prompts(2)
    torch.manual_seed(7)
    assert torch.equal(ref.generate(prompts, attention_mask=torch.ones_like(prompts), **SAMPLING), first["seed_7"])
    torch.manual_seed(100)  # rank 0's seed
    assert torch.equal(ref.generate(prompts, attention_mask=torch.ones_like(prompts), **SAMPLING),
                       first["seeds_differ"])


def _early_eos(tokens):
    """The token that ends both rows soonest (HF's greedy rows ``tokens``)."""
    first = {}
    for token in set(tokens[0].tolist()) & set(tokens[1].tolist()):
        first[token] = max(row.tolist().index(token) for row in tokens)
    return min(first, key=first.get)


class StopAfter(StoppingCriteria):
    """Stops every row once the sequences are ``length`` long."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def _stop_stream_and_score(eos, stop_at):
    """EOS, ``max_length``, a stopping criterion, a streamer on rank 0 and
    ``return_dict_in_generate`` with scores, as a server would use them."""
    model = _tsp_model("llama", dist.get_world_size())
    prompts = _prompts(2, seed=21)
    mask = torch.ones_like(prompts)
    with_eos = model.generate(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                              pad_token_id=eos)
    streamer = RecordingStreamer(_DigitsTokenizer(), skip_prompt=True) if dist.get_rank() == 0 else None
    streamed = model.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=8, pad_token_id=0,
                              streamer=streamer)
    by_length = model.generate(prompts, attention_mask=mask, max_length=PROMPT_LEN + 5, pad_token_id=0)
    stopped = model.generate(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([StopAfter(stop_at)]))
    scored = model.generate(prompts, attention_mask=mask, max_new_tokens=6, pad_token_id=0, num_beams=2,
                            return_dict_in_generate=True, output_scores=True)
    return {"eos": with_eos, "max_length": by_length, "stopped": stopped, "scored": scored.sequences,
            "scores": torch.stack(scored.scores), "beam_scores": scored.sequences_scores, "streamed": streamed,
            "stream_text": None if streamer is None else "".join(streamer.printed)}


class _DigitsTokenizer:
    """Token ids as text, for ``TextStreamer`` on a model without a tokenizer."""

    def decode(self, ids, **kwargs):
        return "".join(f"<{i}>" for i in ids)


class RecordingStreamer(TextStreamer):
    """A ``TextStreamer`` that keeps what it would print."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.printed = []

    def on_finalized_text(self, text, stream_end=False):
        self.printed.append(text)


def test_stopping_streaming_and_scores_as_hugging_face(run_ranks):
    prompts = _prompts(2, seed=21)
    free_run, _ = _hf_reference("llama", prompts)
    eos = _early_eos(free_run[:, PROMPT_LEN:])
    ref = tiny_model("llama")
    mask = torch.ones_like(prompts)
    hf_eos = ref.generate(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                          pad_token_id=eos)
    hf_scored = ref.generate(prompts, attention_mask=mask, max_new_tokens=6, pad_token_id=0, num_beams=2,
                             return_dict_in_generate=True, output_scores=True, output_logits=True)
    stop_at = PROMPT_LEN + 7
    per_rank = run_ranks(2, _stop_stream_and_score, eos=eos, stop_at=stop_at)
    print(f"EOS {eos}: stopped after {hf_eos.shape[1] - PROMPT_LEN} of {NEW_TOKENS} tokens")
    assert hf_eos.shape[1] < PROMPT_LEN + NEW_TOKENS and (hf_eos[:, -1] == eos).all()
    scores_diff = max((r["scores"] - torch.stack(hf_scored.scores)).abs().max().item() for r in per_rank)
    beam_diff = max((r["beam_scores"] - hf_scored.sequences_scores).abs().max().item() for r in per_rank)
    # Both sides run HF's beam search: float64 logits (within TOLERANCE of each other) rounded to float32
    # (u |logit| each, u = 2^-24), then a float32 log-softmax over V tokens per step. Worst case, any machine:
    # the rounded inputs differ by delta = TOLERANCE + 2 u max|logit|; the exact log-softmax moves by at most
    # 2 delta (its max-norm Lipschitz constant); each side's float32 log-softmax is off its exact value by at most
    # (V + 4) u (the sum of V exponentials, each <= 1 and the sum >= 1: (V - 1) u plus the exp's and the log's)
    # plus 3 u |score| (subtracting the max, then the log-sum). A sequence score sums T such steps in float32
    # (T u of it per side, then the length penalty's division, 1 u) over a length >= 1.
    steps, vocab_size = len(hf_scored.scores), COMMON["vocab_size"]
    delta = TOLERANCE + 2 * UNIT_ROUNDOFF * (torch.stack(hf_scored.logits).abs().max().item() + TOLERANCE)
    per_step = 2 * delta + 2 * UNIT_ROUNDOFF * (vocab_size + 4 + 3 * torch.stack(hf_scored.scores).abs().max().item())
    scores_bound = per_step
    beam_bound = steps * per_step + 2 * (steps + 1) * UNIT_ROUNDOFF * hf_scored.sequences_scores.abs().max().item()
    print(f"beam search: step scores max|diff| against HF's (float32) {scores_diff:.2e} (bound {scores_bound:.2e}), "
          f"sequence scores {beam_diff:.2e} (bound {beam_bound:.2e})")
    for r in per_rank:
        assert torch.equal(r["eos"], hf_eos)
        assert torch.equal(r["max_length"], free_run[:, :PROMPT_LEN + 5])
        assert torch.equal(r["stopped"], free_run[:, :stop_at])
        assert torch.equal(r["scored"], hf_scored.sequences)
    assert beam_diff <= beam_bound and scores_diff <= scores_bound
    streamed = per_rank[0]["streamed"]
    assert torch.equal(streamed, free_run[:1, :PROMPT_LEN + 8])
    assert per_rank[0]["stream_text"] == _DigitsTokenizer().decode(streamed[0, PROMPT_LEN:].tolist())
    assert per_rank[1]["stream_text"] is None


def _cached_forward_outside_generate(arch):
    """``model(..., use_cache=True)`` as a user would call it: the prompt,
    then two tokens at once from the returned cache."""
    model = _tsp_model(arch, dist.get_world_size())
    prompts, mask = _left_padded([14, 8])
    first = model(prompts, attention_mask=mask, use_cache=True, logits_to_keep=1)
    new = torch.tensor([[3, 4], [5, 6]])
    second = model(new, attention_mask=torch.cat([mask, torch.ones_like(new)], dim=1), cache=first.cache,
                   logits_to_keep=1)
    return first.logits, second.logits, type(second.cache).__name__, second.cache.get_seq_length()


def test_a_cached_forward_returns_the_cache_as_hugging_face(run_ranks):
    prompts, mask = _left_padded([14, 8])
    ref = tiny_model("qwen3")
    first = ref(prompts, attention_mask=mask, use_cache=True, logits_to_keep=1,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0))  # generate's positions: TSP derives them alike
    new = torch.tensor([[3, 4], [5, 6]])
    second = ref(new, attention_mask=torch.cat([mask, torch.ones_like(new)], dim=1), cache=first.cache,
                 position_ids=mask.sum(1, keepdim=True) + torch.arange(2), logits_to_keep=1)
    per_rank = run_ranks(2, _cached_forward_outside_generate, arch="qwen3")
    for first_logits, second_logits, cache_type, seen in per_rank:
        assert cache_type == "TSPCache" and seen == PROMPT_LEN + 2
        assert (first_logits - first.logits).abs().max() <= TOLERANCE
        assert (second_logits - second.logits).abs().max() <= TOLERANCE


def test_what_a_tsp_cache_cannot_do_is_refused():
    model = _tsp_model("llama", 1)
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="logits_to_keep=1, as model.generate passes it"):
        model(ids, use_cache=True)
    for mask in ([[1, 1, 1, 1, 0, 0], [1] * 6], [[0, 1, 1, 0, 1, 1], [1] * 6]):
        with pytest.raises(ValueError, match="attention_mask must be left padding"):
            model.generate(ids, attention_mask=torch.tensor(mask), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(ids, attention_mask=torch.tensor([[0] * 6, [1] * 6]), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="position_ids must count each prompt's real tokens"):
        model(ids, position_ids=torch.arange(6).expand(2, -1) + 1, use_cache=True, logits_to_keep=1)
    cache = model(ids, use_cache=True, logits_to_keep=1).cache
    assert isinstance(cache, TSPCache)
    with pytest.raises(ValueError, match="must be real"):
        model(ids[:, :1], attention_mask=torch.tensor([[1] * 6 + [0]] * 2), cache=cache, logits_to_keep=1)
    with pytest.raises(ValueError, match="assisted and speculative decoding"):
        model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=4, pad_token_id=0,
                       prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="takes no labels"):
        model(ids, labels=ids, use_cache=True, logits_to_keep=1)


def _resident_bytes(arch, context):
    """This rank's weight bytes, and its KV cache bytes after a prefill of ``context`` tokens."""
    model = _tsp_model(arch, dist.get_world_size())
    _, cache = cached_forward(model, _prompts(1)[:, :context], logits_to_keep=1)
    return sum(p.numel() * p.element_size() for p in model.parameters()), cache.nbytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma4", "gemma4_moe"])
def test_the_serving_planner_counts_what_each_rank_keeps(run_ranks, arch):
    """``ds-tsp plan --serve``: TSP's weights per rank are the most any rank
    holds, its KV cache per token what the cache holds (float64: e = 8);
    Gemma 4's full layers with their own heads, keys as values."""
    from ds_tsp.planning import serving_plans
    config = tiny_model(arch).config.to_dict()
    single, _, tsp = serving_plans(config, 2, micro_batch=1, dtype="fp32")
    per_rank = run_ranks(2, _resident_bytes, arch=arch, context=PROMPT_LEN)
    # fp32's element is 4 bytes; these models are float64: twice the planned bytes.
    assert max(weights for weights, _ in per_rank) == 2 * tsp.weights
    assert sum(cache for _, cache in per_rank) == 2 * single.kv_cache(PROMPT_LEN)
    assert max(cache for _, cache in per_rank) <= 2 * tsp.kv_cache(PROMPT_LEN)
    assert single.weights == sum(p.numel() for p in tiny_model(arch).parameters()) * 4


def test_the_cache_reorders_expands_and_selects_rows_as_hugging_faces_does():
    """``TSPCache``'s row operations (beam search, expansion, selection) move
    every layer's keys and values, the positions, validity and next positions
    alike, and storage grows past its first size."""
    cache = TSPCache(num_layers=2, batch=3, dtype=torch.float64, device="cpu", tsp_rank=0, rank_counts=[2],
                     shapes=dict.fromkeys(range(2), (1, 2, None)))
    slots = cache.reserve(torch.tensor([[0, 1]] * 3), torch.ones(3, 2, dtype=torch.bool))
    for layer in range(2):
        rows = torch.arange(3, dtype=torch.float64).view(3, 1, 1, 1).expand(3, 2, 1, 2) + 10 * layer
        cache.write(layer, slots, rows, -rows)
    cache.next_positions = torch.tensor([2, 5, 7])
    grown = cache.reserve(torch.tensor([[2]] * 3), torch.ones(3, 1, dtype=torch.bool))  # past the first capacity
    assert grown == slice(2, 3) and cache.capacity > 2 and cache.length == 3
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.next_positions.tolist() == [7, 7, 2]
    assert cache.layer(1)[0][:, 0, 0, 0].tolist() == [12.0, 12.0, 10.0] and cache.layer(1)[1][2, 0, 0, 0] == -10
    cache.batch_repeat_interleave(2)
    assert cache.next_positions.tolist() == [7, 7, 7, 7, 2, 2] and cache.positions.shape == (6, 3)
    cache.batch_select_indices(torch.tensor([4, 0]))
    assert cache.next_positions.tolist() == [2, 7] and cache.layer(0)[0][:, 0, 0, 0].tolist() == [0.0, 2.0]
    assert cache.nbytes() == 2 * 2 * 2 * 3 * 1 * 2 * 8  # layers x (K, V) x rows x filled slots x nkv x d x 8 bytes
    with pytest.raises(NotImplementedError, match="cannot roll tokens back"):
        cache.crop(1)
    with pytest.raises(TypeError, match="read and written by the TSP decoder"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)


@pytest.mark.parametrize("arch, tsp_size", [("gemma", 2), ("gemma", 4), ("gemma2", 2), ("gemma3", 2),
                                            ("vaultgemma", 2), ("olmo2", 2), ("olmo3", 4), ("hunyuan_v1_dense", 2),
                                            ("hunyuan_v1_moe", 2), ("ernie4_5", 2), ("flint", 2), ("ministral3", 2),
                                            ("cohere", 2), ("cohere2", 2), ("cohere2_moe", 2), ("nemotron", 2),
                                            ("granitemoe", 2), ("llama4", 2), ("llama4", 4),
                                            ("hyperclovax", 2), ("gemma4", 2), ("gemma4", 4),
                                            ("gemma4_moe", 2), ("gemma4_shared_kv", 2), ("gemma4_shared_kv", 4),
                                            ("gemma4_layer_inputs", 2)])
def test_the_gemma_and_olmo_families_generate_as_hugging_face(run_ranks, arch, tsp_size):
    """Gemma's folded embedding scales the rows it looks up (prefill and each
    new token) as Hugging Face's does; Gemma-2's scores and final logits are
    soft-capped in decoding too (VaultGemma's under pre-norms), its sliding
    layers see their window of the cache, Gemma-3's layers their own RoPE
    table; OLMo-2/3 norm each new token's queries and keys over all heads,
    Hunyuan's after rotating them; ERNIE 4.5 rotates them by its own
    (interleaved) function, Flint's full layers not at all, and Ministral 3
    scales each new query by its position; Cohere's blocks run side by side
    and its logits are scaled (Command A's full layers without positions);
    Nemotron's ungated MLP shares its decode step as the gated one;
    Granite-MoE's multipliers scale each new token's embedding, residuals and logits;
    Llama 4's chunked layers see the new token's chunk of the cache only, its
    NoPE layer's queries are tuned at their cache position (the left padding
    counted, as Hugging Face counts it) and its experts take inputs scaled by
    their routing weights; HyperCLOVA X's logits are multiplied by its
    logits_scaling; Gemma 4's full layers cache wider heads, fewer of them,
    whose keys are their values, every layer's values normed; its experts
    beside the MLP take each new token; its key/value-sharing layers cache
    nothing and attend to the cache of the layer whose keys they share; its
    per-layer inputs come from the folded per-layer embedding for the prompt
    and for each new token."""
    prompts, mask = _left_padded(LEFT_PADDED_LENGTHS)
    ref_tokens, ref_logits = _hf_reference(arch, prompts, attention_mask=mask, max_new_tokens=12)
    per_rank = run_ranks(tsp_size, _run_generate, arch=arch, input_ids=prompts, attention_mask=mask,
                         max_new_tokens=12)
    diff = _max_logit_diff(per_rank, ref_logits)
    print(f"D={tsp_size} {arch}: max|logit diff| {diff:.2e}")
    assert all(torch.equal(r["sequences"], ref_tokens) for r in per_rank)
    assert diff <= TOLERANCE
