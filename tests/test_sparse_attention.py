"""DeepSeek's sparse attention (DeepSeek-V3.2, GLM-MoE-DSA) under TSP against
the unsharded Hugging Face model, float64: the lightning indexer's choice of
keys, the attention over them, and what is refused by name."""

import copy
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.blocks.latent import indexer, schedule
from ds_tsp.config import TSPConfig
from ds_tsp.injection.policy import AUTO, PolicyError, check_config
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.planning.communication import latent_attention_bytes_by_op
from ds_tsp.planning.shapes import model_shape
from models import SPARSE_MLA_ARCHS, tiny_causal_lm, tiny_model
from parity import check, check_caught, model_parity, packed_position_ids
from test_latent import _layer_bytes

# Padded (13 tokens, the last 3 of a row masked) and packed (documents restarting the positions) inputs; the
# indexer keeps 5 keys a query, so that from a row's (or document's) sixth token on its choice matters.
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_sparse_attention_matches_hugging_face(run_ranks, tsp_size):
    """DeepSeek-V3.2, GLM-MoE-DSA (its shared indexer layers) and HY-V4 (its shared indexer layer, output gate,
    sinks and hyper-connections), in both latent forms, padded and packed: loss and every gradient within 1e-10
    of Hugging Face's (the indexers' weights take none in either; HY-V4's float32 casts widened in both,
    ``models.widen_float32_casts``)."""
    for arch in SPARSE_MLA_ARCHS:
        for form in schedule.FORMS:
            for case in CASES:
                per_rank = run_ranks(tsp_size, model_parity, arch=arch, latent_attention=form, **case)
                check(per_rank, f"D={tsp_size} {arch} {form} {case}")


def test_activation_checkpointing_recomputes_a_shared_choice_exactly(run_ranks):
    """GLM-MoE-DSA at D=2 under Hugging Face's layer checkpointing: a recomputed layer that reuses an earlier
    layer's choice gets it again as its checkpoint's input. Checkpoints in host memory, which keep one input a
    layer, refuse it by name."""
    check(run_ranks(2, model_parity, arch="glm_moe_dsa", batch=2, seq_len=13, right_padding=3, checkpointing=True),
          "D=2 glm_moe_dsa checkpointing")
    with pytest.raises(Exception, match="cpu_checkpointing.*indexer_types"):
        run_ranks(2, model_parity, arch="glm_moe_dsa", batch=2, seq_len=13, checkpointing="host")


def _small_tiles(body, **kwargs):
    """``body`` with the indexer scoring 4 queries against 3 keys at a time (and attending 4 queries at a time),
    so that a query's top-k is merged over many key tiles."""
    with mock.patch.object(indexer, "QUERY_TILE", 4), mock.patch.object(indexer, "KEY_TILE", 3):
        return body(**kwargs)


def test_small_tiles_give_the_same_numbers(run_ranks):
    """The running top-k across key tiles and the attention by query tiles change nothing (D = 2)."""
    for form in schedule.FORMS:
        for case in CASES:
            per_rank = run_ranks(2, _small_tiles, body=model_parity, arch="deepseek_v32", latent_attention=form,
                                 **case)
            check(per_rank, f"D=2 deepseek_v32 {form} {case}, 4 x 3 tiles")


def _chosen_keys(arch, batch, seq_len, right_padding=0, documents=None):
    """Every indexer layer's choice per query, as sets of natural key indices: Hugging Face's (its indexer's
    top-k, less the keys its mask hides) and this rank's queries' under TSP, by natural query position."""
    D, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(7)
    ref = tiny_model(arch)
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len))
    attention_mask = None
    if right_padding:
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, -right_padding:] = 0
    positions = None if documents is None else packed_position_ids(documents)
    hf_choices = []

    def record(module, args, output):
        visible = args[3]  # the (B, S, T) mask the indexer scores under: True (or 0, added) where a key may be seen
        visible = visible if visible.dtype == torch.bool else visible == 0
        hf_choices.append([[(sorted(k for k in output[b, q].tolist() if visible[b, q, k]), int(visible[b, q].sum()))
                            for q in range(seq_len)] for b in range(batch)])

    hooks = [layer.self_attn.indexer.register_forward_hook(record) for layer in ref.model.layers
             if layer.self_attn.indexer is not None]
    with torch.no_grad():
        ref(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    for hook in hooks:
        hook.remove()
    model = copy.deepcopy(ref)
    ds_tsp.inject(model, TSPTopology(D), TSPConfig(enabled=True, size=D, attention_backend="sdpa"))
    mine, choose = [], schedule.choose_keys
    with mock.patch.object(schedule, "choose_keys", side_effect=lambda *a: (mine.append(choose(*a)), mine[-1])[1]), \
            torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    local = layout.positions(r, D, "zigzag", mine[0].shape[1] * D).tolist()
    tsp_choices = [[{p: sorted(k for k in chosen[b, i].tolist() if k != indexer.NOT_CHOSEN)
                     for i, p in enumerate(local)} for b in range(batch)] for chosen in mine]
    return dict(hf=hf_choices, tsp=tsp_choices)


@pytest.mark.parametrize("tsp_size, tiles", [(2, "default"), (4, "default"), (2, "small")])
def test_the_chosen_keys_are_hugging_faces(run_ranks, tsp_size, tiles):
    """Every real query's chosen keys, on every rank and indexer layer, equal the keys Hugging Face's indexer
    chose that its mask lets it see; the choice is a proper subset of the visible keys from the sixth on."""
    for arch in SPARSE_MLA_ARCHS:
        for case in CASES:
            if tiles == "small":
                per_rank = run_ranks(tsp_size, _small_tiles, body=_chosen_keys, arch=arch, **case)
            else:
                per_rank = run_ranks(tsp_size, _chosen_keys, arch=arch, **case)
            compared = narrowed = 0
            for out in per_rank:
                for hf_layer, tsp_layer in zip(out["hf"], out["tsp"]):
                    for b, row in enumerate(tsp_layer):
                        real = case["seq_len"] - (case.get("right_padding", 0) if b == 0 else 0)
                        for p, keys in row.items():
                            if p < real:
                                hf_keys, seen = hf_layer[b][p]
                                assert keys == hf_keys, (arch, case, b, p, keys, hf_keys)
                                compared += 1
                                narrowed += len(keys) < seen
            print(f"D={tsp_size} {tiles} tiles {arch} {case}: {compared} queries' choices equal Hugging Face's, "
                  f"{narrowed} of them fewer keys than the query sees")
            assert narrowed > compared // 3


@pytest.mark.parametrize("arch", list(SPARSE_MLA_ARCHS))
def test_generate_gives_hugging_faces_tokens(run_ranks, arch):
    """At D = 2, greedy from 2 prompts of 12 tokens for 8 new ones (the indexer keeps 5 keys a query): the tokens
    and every step's logits against Hugging Face's, then greedy, beam search and penalties on left-padded
    prompts; each rank's cache holds its tokens' latent, rotary key and index key."""
    from test_generate import _hf_reference, _prompts, _run_generate, check_strategies_on_left_padded_prompts

    prompts = _prompts(2, seed=9)
    ref_tokens, ref_logits = _hf_reference(arch, prompts, max_new_tokens=8)
    per_rank = run_ranks(2, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=8)
    config = tiny_model(arch).config
    diff = max((r["logits"] - ref_logits).abs().max().item() for r in per_rank)
    print(f"D=2 {arch}: max|logit diff| {diff:.2e}; cache {[r['cache_bytes'] for r in per_rank]} B")
    for r in per_rank:
        assert torch.equal(r["sequences"], ref_tokens)
    indexed = sum(kind == "full" for kind in getattr(config, "indexer_types", None) or ["full"] * 2)
    width = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers + \
        config.index_head_dim * indexed
    assert all(r["cache_bytes"] == 2 * r["cache_tokens"] * width * 8 for r in per_rank)
    assert diff <= 1e-10
    check_strategies_on_left_padded_prompts(run_ranks, arch)  # greedy, beam search, penalties; left padding


def _decode_step_received(batch):
    """One decode step of a dense-MLP DeepSeek-V3.2 at this rank: the bytes it received, by op."""
    from ds_tsp.inference.generate import cached_forward
    from test_generate import _prompts, _tsp_model

    model = _tsp_model("deepseek_v32", dist.get_world_size(), mlp_layer_types=["dense", "dense"])
    logits, cache = cached_forward(model, _prompts(batch, seed=9), logits_to_keep=1)
    comm.counter.reset()
    cached_forward(model, logits.argmax(dim=-1), cache=cache, logits_to_keep=1)
    return {op: counts["received"] for op, counts in comm.counter.snapshot().items()}


def test_a_decode_step_moves_latent_decodes_bytes_and_the_indexers(run_ranks):
    """At D = 2, float64: a decode step of DeepSeek-V3.2 receives the dense latent attention's bytes
    (test_latent's formula) and, a layer, every other rank's rows of the new token's wq_b and wk outputs and its
    best index_topk (score, position) pairs in float64 (``inference.latent_decode``'s docstring)."""
    from test_latent import _decode_step_bytes

    config = tiny_model("deepseek_v32", mlp_layer_types=["dense", "dense"]).config
    B, D, e = 2, 2, 8
    rows = [config.index_n_heads * config.index_head_dim, config.index_head_dim]
    widest = max(sum((j + 1) * n // D - j * n // D for n in rows) for j in range(D))
    indexer = config.num_hidden_layers * (D - 1) * B * (widest * e + 2 * config.index_topk * 8)
    expected = _decode_step_bytes(config, B) + indexer
    for received in run_ranks(D, _decode_step_received, batch=B):
        print(f"D=2 deepseek_v32 decode step: received {received}, expected {expected} B in all "
              f"({indexer} B of them the indexer's)")
        assert set(received) <= {"all_gather", "all_to_all"}
        assert sum(received.values()) == expected


def _wrong_choice(how, **kwargs):
    """``model_parity`` with the indexer wrong: ``"key_row"`` moves every index key one token later,
    ``"local_only"`` chooses among this rank's own keys only, ``"not_causal"`` lets a query choose later keys."""
    rank, size = dist.get_rank(), dist.get_world_size()
    choose, see = schedule.choose_keys, indexer.visible

    def rolled(ip, q, weights, keys):
        return choose(ip, q, weights, keys.roll(1, dims=1))

    def local_only(keys, first, last):
        own = layout.positions(rank, size, "zigzag", kwargs["seq_len"] + (-kwargs["seq_len"]) % (2 * size))
        return see(keys, first, last) & torch.isin(keys, own)

    patch = {"key_row": mock.patch.object(schedule, "choose_keys", rolled),
             "local_only": mock.patch.object(indexer, "visible", local_only),
             "not_causal": mock.patch.object(indexer, "visible", lambda keys, first, last: keys >= first)}[how]
    # Injection's probe would refuse the wrong layer already (it compares it with Hugging Face's): skipped, so that
    # the check under test is the one that catches it.
    with patch, mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


@pytest.mark.parametrize("how", ["key_row", "local_only", "not_causal"])
def test_a_wrong_choice_is_caught(run_ranks, how):
    check_caught(run_ranks(2, _wrong_choice, how=how, arch="deepseek_v32", batch=2, seq_len=13), how)


def test_bytes_equal_the_planner_op_by_op(run_ranks):
    """DeepSeek-V3.2's layer at D = 4: every op each rank receives equals the planner's, forward and backward;
    the forward's gather carries index_head_dim more elements a token than the latent's (backward's does not)."""
    config = tiny_model("deepseek_v32").config
    B, S, D, elem = 2, 16, 4, 8
    sizes = (config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
             config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    indexer_sizes = dict(index_heads=config.index_n_heads, index_head_dim=config.index_head_dim)
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * (D - 1) * B * S // D
    index_keys = config.index_head_dim * (D - 1) * B * S // D
    for form in schedule.FORMS:
        for out in run_ranks(D, _layer_bytes, arch="deepseek_v32", batch=B, seq_len=S, form=form):
            planned = {direction: latent_attention_bytes_by_op(*sizes, B * S, D, out["rank"], elem, direction,
                                                               **indexer_sizes)
                       for direction in ("forward", "both")}
            print(f"deepseek_v32 {form} rank {out['rank']}: forward {out['forward']}, planned {planned['forward']}; "
                  f"fwd+bwd {out['both']}, planned {planned['both']}")
            assert out["forward"]["all_gather"] == (latent + index_keys) * elem
            assert out["both"]["all_gather"] == (2 * latent + index_keys) * elem
            assert out["forward"] == planned["forward"]
            assert out["both"] == planned["both"]


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_step_bytes_equal_what_the_model_counts(run_ranks, tsp_size):
    """A whole training step of DeepSeek-V3.2 and GLM-MoE-DSA (its layers reusing the first's choice move no
    indexer bytes), per rank and op, against tsp_step_bytes_by_op."""
    from test_plan_communication import _check_counted_steps, _counted_model_steps

    dtype = torch.float64 if tsp_size == 2 else torch.bfloat16
    # The planner does not model HY-V4 (its hyper-connected streams): it refuses its config by name.
    cases = [(arch, dtype, True, False) for arch in ("deepseek_v32", "glm_moe_dsa")] + \
        [("deepseek_v32", dtype, True, True)]
    _check_counted_steps(tsp_size, cases, run_ranks(tsp_size, _counted_model_steps, cases=cases))


def test_the_planner_adds_the_index_keys_to_deepseek_v32s_gather():
    """At DeepSeek-V3.2's sizes (the deepseek-v3.2 preset), a layer's forward gather is (kv_lora_rank +
    qk_rope_head_dim + index_head_dim) (D-1)/D B*S elements: 576 + 128 a token."""
    m = model_shape("deepseek-v3.2")
    D, tokens, e = 8, 4096, 2
    sizes = (m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
             m.v_head_dim)
    forward = latent_attention_bytes_by_op(*sizes, tokens, D, 0, e, "forward", index_heads=m.index_heads,
                                           index_head_dim=m.index_head_dim)
    plain = latent_attention_bytes_by_op(*sizes, tokens, D, 0, e, "forward")
    per_token = forward["all_gather"] * D / ((D - 1) * tokens * e)
    print(f"deepseek-v3.2 at D = {D}: the forward gather moves {per_token} elements a token "
          f"({m.latent_width} latent and rotary key + {m.index_head_dim} index key); the indexer's pieces add "
          f"{forward['broadcast'] - plain['broadcast']} broadcast bytes a rank")
    assert per_token == m.latent_width + m.index_head_dim == 576 + 128
    assert forward["broadcast"] - plain["broadcast"] == e * (D - 1) * m.indexer_params // D


def test_the_planner_counts_the_indexer_and_the_sparse_attention_flops():
    """DeepSeek-V3.2 at 128K tokens: each query attends to 2048 keys, 3.1% of the dense attention's pairs; the
    indexer scores every causal pair (64 heads of 128 and their weights) and projects every token, forward only."""
    from ds_tsp.planning.flops import indexer_flops, twice_attended_pairs

    m = model_shape("deepseek-v3.2")
    S, k = 131072, 2048
    assert twice_attended_pairs(S, k) == k * k + 2 * (S - k) * k
    assert twice_attended_pairs(1000, k) == twice_attended_pairs(1000) == 1000 * 1000
    projections = 64 * 128 * 1536 + 128 * 7168 + 64 * 7168
    assert indexer_flops(m, 1, S) == 2 * S * projections + S * S * 64 * (128 + 1)
    print(f"deepseek-v3.2 at {S} tokens: sparse attention {twice_attended_pairs(S, k) / S ** 2:.2%} of the dense "
          f"pairs; the indexer {indexer_flops(m, 1, S) / 1e12:.1f} TFLOPs a layer, forward")
    assert indexer_flops(model_shape("deepseek-v3"), 1, S) == 0


def test_a_shared_choice_without_an_indexer_before_it_is_refused_by_name():
    """GLM-MoE-DSA whose first layer would reuse a choice no layer made: refused before any weights are read
    (Hugging Face's forward fails on it mid-way)."""
    model = tiny_causal_lm("glm_moe_dsa", device="meta", indexer_types=["shared", "full"])
    with pytest.raises(PolicyError, match="config.indexer_types = \\['shared', 'full'\\].*\"full\""):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1))


def test_what_deepseek_v4_builds_is_refused_by_name():
    """DeepSeek-V4's pieces, each by name before any weights are loaded: its low-rank grouped output projection,
    its compressed attention and its hash-routed MoE layers."""
    model = tiny_causal_lm("deepseek_v4", device="meta")
    with pytest.raises(PolicyError, match="config.o_lora_rank = 1024.*low-rank grouped output projection"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1))
    for key, match in (("compress_rates", "compressed attention"), ("mlp_layer_types", "hash_moe.*hash-routed")):
        alone = dataclasses.replace(AUTO, config={key: AUTO.config[key]})
        with pytest.raises(PolicyError, match=f"config.{key} = .*{match}"):
            check_config(type(model).__name__, model.config, alone)
