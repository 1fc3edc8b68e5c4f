"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4, Youtu) under TSP
against the unsharded Hugging Face model, float64; its bytes against the planner."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ds_tsp.blocks.latent import schedule
from ds_tsp.blocks.latent.module import TSPLatentAttention
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.planning.communication import latent_attention_bytes_by_op
from ds_tsp.planning.flops import cheaper_latent_form
from models import MLA_ARCHS, MLA_TINY, tiny_causal_lm, tiny_model
from parity import TOLERANCE, check, check_caught, model_parity

# Padded (13 tokens, the last 3 of a row masked) and packed (documents restarting the positions) inputs.
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_latent_attention_matches_hugging_face(run_ranks, tsp_size):
    """Every MLA class of the test models, in both forms, padded and packed:
    loss and every gradient within 1e-10 of Hugging Face's."""
    for arch in MLA_ARCHS:
        for form in schedule.FORMS:
            for case in CASES:
                per_rank = run_ranks(tsp_size, model_parity, arch=arch, latent_attention=form, **case)
                check(per_rank, f"D={tsp_size} {arch} {form} {case}")


@pytest.mark.parametrize("checkpointing", [True, "host"])
def test_activation_checkpointing_recomputes_the_latent_attention_exactly(run_ranks, checkpointing):
    """Mistral 4 at D=2 under Hugging Face's layer checkpointing and with the checkpoints in host memory: the
    recomputed layers get their positions (the query scale) and rotary tables again."""
    check(run_ranks(2, model_parity, arch="mistral4", batch=2, seq_len=13, checkpointing=checkpointing),
          f"D=2 mistral4 checkpointing={checkpointing}")


def _gathered_wrong(how, **kwargs):
    """``model_parity`` with the gathered latent corrupted: ``"shards"`` puts the
    ranks' chunks in reverse order, ``"rotary_key"`` moves the rotary keys one token later."""
    gather = schedule.gather_latent

    def wrong(plan, latent):
        full = gather(plan, latent).wait()
        if how == "shards":
            full = torch.cat(full.chunk(2 * plan.tsp_size, dim=1)[::-1], dim=1)
        else:
            rope = plan.shapes.qk_rope_head_dim
            full = torch.cat([full[..., :-rope], full[..., -rope:].roll(1, dims=1)], dim=-1)
        return comm.Pending(None, lambda: full)

    # Injection's probe would refuse the corrupted layer already (it compares it with Hugging Face's): skipped, so
    # that the check under test is the one that catches it.
    with mock.patch.object(schedule, "gather_latent", wrong), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


@pytest.mark.parametrize("form", schedule.FORMS)
def test_a_wrong_latent_or_shard_is_caught(run_ranks, form):
    for label, body, kwargs in (("latent from the wrong shards", _gathered_wrong, {"how": "shards"}),
                                ("rotary key one row late", _gathered_wrong, {"how": "rotary_key"}),
                                ("head group scaled", model_parity, {"wrong_shard": "model.layers.0.self_attn"})):
        check_caught(run_ranks(2, body, arch="deepseek_v3_dense", batch=2, seq_len=13, latent_attention=form,
                               **kwargs), f"{form}, {label}")


def _layer_bytes(arch, batch, seq_len, form):
    """One MLA layer's forward and backward on this rank's tokens: the bytes it received, by op."""
    topo = TSPTopology(dist.get_world_size())
    D, r = topo.tsp_size, topo.tsp_rank
    model = tiny_model(arch)
    attn = model.model.layers[0].self_attn
    tsp = TSPLatentAttention.from_hf(attn, model.config, topo.tsp_group, form=form)
    torch.manual_seed(1)
    x = layout.shard(torch.randn(batch, seq_len, model.config.hidden_size, dtype=torch.float64), r, D, "zigzag")
    x.requires_grad_()
    positions = layout.positions(r, D, "zigzag", seq_len).unsqueeze(0).expand(batch, -1)
    tables = model.model.rotary_emb(x, positions)
    comm.counter.reset()
    y = tsp(x, tables)
    forward = {op: counts["received"] for op, counts in comm.counter.snapshot().items()}
    y.backward(torch.ones_like(y))
    both = {op: counts["received"] for op, counts in comm.counter.snapshot().items()}
    return dict(rank=r, forward=forward, both=both)


@pytest.mark.parametrize("arch", ["deepseek_v3_dense", "deepseek_v2_lite"])
def test_bytes_equal_the_planner_op_by_op(run_ranks, arch):
    """At D = 4 the latent all-gather of a layer is (kv_lora_rank +
    qk_rope_head_dim) (D-1)/D B*S elements, printed beside what a per-head
    K/V all-gather of the same layer would move; every op equals the planner's."""
    config = tiny_model(arch).config
    B, S, D, elem = 2, 16, 4, 8
    sizes = (config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
             config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * (D - 1) * B * S // D
    per_head_kv = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                + config.v_head_dim) * (D - 1) * B * S // D
    for form in schedule.FORMS:
        for out in run_ranks(D, _layer_bytes, arch=arch, batch=B, seq_len=S, form=form):
            planned = {direction: latent_attention_bytes_by_op(*sizes, B * S, D, out["rank"], elem, direction)
                       for direction in ("forward", "both")}
            print(f"{arch} {form} rank {out['rank']}: latent all-gather {out['forward']['all_gather'] // elem} "
                  f"elements (a per-head K/V all-gather: {per_head_kv}); forward {out['forward']}, "
                  f"planned {planned['forward']}; fwd+bwd {out['both']}, planned {planned['both']}")
            assert out["forward"]["all_gather"] == latent * elem
            assert out["forward"] == planned["forward"]
            assert out["both"] == planned["both"]


def test_the_cost_model_expands_long_sequences_and_absorbs_few_queries():
    """DeepSeek-V3's shapes: expanded for 32K tokens over 8 ranks, absorbed for one decoded token and for 4K
    tokens over 64 ranks (64 queries a rank against 4,096 keys to expand); the zigzag layout's pairs counted
    as a rank's query blocks score them."""
    from ds_tsp.blocks.latent.module import zigzag_work
    from ds_tsp.blocks.latent.shards import LatentShapes

    for D, S, form in ((8, 32768, "expanded"), (64, 4096, "absorbed")):
        shapes = LatentShapes(7168, 128, 1536, 512, 128, 64, 128, D)
        assert cheaper_latent_form(shapes, *zigzag_work(1, S // D, D)) == form, (D, S)
    assert cheaper_latent_form(LatentShapes(7168, 128, 1536, 512, 128, 64, 128, 8), 1, 1, 32768) == "absorbed"


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_lite", "mistral4"])
def test_generate_gives_hugging_face_tokens_from_a_sharded_latent_cache(run_ranks, arch):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's,
    greedy, beam search and penalties on left-padded prompts; each rank's cache
    holds its tokens' latent and rotary key only, half of the sequence."""
    from test_generate import _hf_reference, _prompts, _run_generate, check_strategies_on_left_padded_prompts

    prompts = _prompts(2, seed=9)
    ref_tokens, ref_logits = _hf_reference(arch, prompts, max_new_tokens=8)
    per_rank = run_ranks(2, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=8, measure_step=True)
    config = tiny_model(arch).config
    width = config.kv_lora_rank + config.qk_rope_head_dim
    total = prompts.shape[1] + 8 - 1  # the last token is generated, not cached
    per_head_kv = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                + config.v_head_dim) * 8  # bytes a token and layer
    diff = max((r["logits"] - ref_logits).abs().max().item() for r in per_rank)
    for r in per_rank:
        print(f"D=2 {arch}: max|logit diff| {diff:.2e}; cache {r['cache_tokens']} of {total} tokens, "
              f"{r['cache_bytes']} B (a per-head K/V cache of them: "
              f"{r['cache_tokens'] * config.num_hidden_layers * 2 * per_head_kv} B)")
        assert torch.equal(r["sequences"], ref_tokens)
        assert abs(r["cache_tokens"] - total / 2) <= 1
        assert r["cache_bytes"] == config.num_hidden_layers * 2 * r["cache_tokens"] * width * 8
    assert sum(r["cache_tokens"] for r in per_rank) == total
    assert diff <= TOLERANCE
    for r in per_rank:  # a decode step moves no weight: latent_decode's formula, float64 (e = a = 8 bytes)
        assert set(r["step_ops"]) <= {"all_gather", "all_to_all"}
        assert sum(op["received"] for op in r["step_ops"].values()) == _decode_step_bytes(config, prompts.shape[0])
    check_strategies_on_left_padded_prompts(run_ranks, arch)


def _inject(model, **options):
    import ds_tsp
    from ds_tsp.config import TSPConfig

    ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1, **options))


def _indexer_with_a_key_bias():
    """DeepSeek-V3.2 whose lightning indexers' key projections have biases, which the TSP indexer does not take."""
    model = tiny_causal_lm("deepseek_v32", **MLA_TINY, index_n_heads=8, index_head_dim=8, index_topk=4)
    for layer in model.model.layers:
        wk = layer.self_attn.indexer.wk
        layer.self_attn.indexer.wk = torch.nn.Linear(wk.in_features, wk.out_features, dtype=wk.weight.dtype)
    return model


@pytest.mark.parametrize("build, options, match", [
    (lambda: _indexer_with_a_key_bias(), {}, "indexer holds.*without biases"),
    (lambda: tiny_model("deepseek_v3_dense"), {"attention_backend": "flash"}, "tsp.attention_backend = 'flash'.*SDPA"),
])
def test_what_the_latent_attention_does_not_build_is_refused_by_name(build, options, match):
    with pytest.raises((PolicyError, ValueError), match=match):
        _inject(build(), **options)


def test_multi_token_prediction_layers_are_named_as_not_built(caplog):
    """DeepSeek-V3's checkpoints describe one; Hugging Face's model builds none (its loader drops their weights),
    and neither does ds_tsp: the model is taken, and the log says so."""
    model = tiny_model("deepseek_v3_dense")
    assert model.config.num_nextn_predict_layers == 1
    with caplog.at_level("WARNING", logger="ds_tsp"):
        _inject(model, attention_backend="sdpa")
    assert "num_nextn_predict_layers = 1 multi-token-prediction layer(s) are not built" in caplog.text


def _decode_step_bytes(config, batch, tsp_size=2):
    """``ds_tsp.inference.latent_decode``'s bytes a rank receives in one decode step, float64, plus the MLP's
    output all-gather, the new tokens' embedding rows and the logits slices (``inference.generate``)."""
    from ds_tsp.blocks.vocab import shard_rows

    D, H, e = tsp_size, config.hidden_size, 8
    width = config.kv_lora_rank + config.qk_rope_head_dim
    widest = max(sum((j + 1) * n // D - j * n // D for n in (config.q_lora_rank, width) if n) for j in range(D))
    hq = config.num_attention_heads // D
    attention = widest + hq * width + hq * (config.kv_lora_rank + 1) + H
    per_layer = (D - 1) * batch * (attention + H) * e
    return config.num_hidden_layers * per_layer + (D - 1) * batch * (shard_rows(config.vocab_size, D) + H) * e
