"""Packed documents (position ids that restart) against Hugging Face, float64."""

import itertools
import math
from unittest import mock

import pytest
import torch

from ds_tsp.parallel import layout
from ds_tsp.blocks.attention.kernels import bottom_right_causal_mask
from ds_tsp.blocks.documents import bidirectional_spans, document_starts, query_blocks
from float32_control import UNIT_ROUNDOFF
from models import tiny_model
from parity import TOLERANCE, check, model_parity, packed_position_ids

# Row 0 packs four documents, one of length 1, across the chunk boundaries of
# every D; row 1 is one document. 19 tokens also need padding at every D > 1.
DOCUMENTS = [[6, 1, 8, 4], [19]]
MOE_DOCUMENT_ARCHS = ("glm4_moe", "gpt_oss", "minimax_m2", "olmoe", "dots1", "mellum")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_packed_documents_match_hugging_face(run_ranks, tsp_size):
    for arch in ("llama", "mistral"):  # mistral's sliding window takes the autograd-recompute path
        per_rank = run_ranks(tsp_size, model_parity, arch=arch, batch=2, seq_len=19, documents=DOCUMENTS)
        check(per_rank, f"D={tsp_size} {arch} packed {DOCUMENTS}")
    per_rank = run_ranks(tsp_size, model_parity, arch="llama", batch=2, seq_len=19, documents=DOCUMENTS,
                         layout="contiguous")
    check(per_rank, f"D={tsp_size} llama packed {DOCUMENTS}, contiguous layout")
    # The MoE models (their load-balancing loss off: its float32 statistics are checked in test_moe.py): tokens
    # route alone; GPT-OSS's sinks join each document's softmax, on sliding and full layers; MiniMax-M2's and
    # OLMoE's q/k norms over the projection; dots.llm1 and Mellum by the auto policy.
    for arch, schedule in itertools.product(MOE_DOCUMENT_ARCHS, ("ring", "all_to_all")):
        per_rank = run_ranks(tsp_size, model_parity, arch=arch, batch=2, seq_len=19, documents=DOCUMENTS,
                             moe_schedule=schedule, model_overrides={"output_router_logits": False})
        check(per_rank, f"D={tsp_size} {arch} packed {DOCUMENTS}, {schedule}")


def test_flash_attention_cu_seq_lens_match_hugging_face(run_ranks):
    documents = [[3, 1, 9, 3]]
    per_rank = run_ranks(2, model_parity, arch="qwen3", batch=1, seq_len=16, documents=documents, cu_seq_lens=True)
    check(per_rank, f"D=2 qwen3 cu_seq_lens {documents}")


def test_unpacked_attention_would_be_caught(run_ranks):
    """The guard: the same packed batch attended as one sequence per row (the
    documents dropped) is far from HF's document-masked result."""
    per_rank = run_ranks(2, model_parity, arch="llama", batch=2, seq_len=19, documents=DOCUMENTS,
                         ignore_documents=True)
    worst = max(d["loss"] for d in per_rank)
    print(f"documents ignored: |loss diff| {worst:.2e}")
    assert worst > 1e3 * TOLERANCE


def test_the_reference_masks_documents_as_eager_attention_does():
    """HF's sdpa (the float64 reference) and eager attention (softmax in
    float32) read the same documents from the position ids (without a cache:
    with one, HF attends across the documents).

    Bound, derived (any machine): eager's float32 softmax over at most S keys
    errs by at most (S + 3) u of each probability p (u = 2^-24: the rounded
    scores' exp, a sum of S terms, the division, and the cast back to float64
    exact), so the loss moves by at most (S + 3) u sum |dL/dp| p, to first
    order; that sum is measured by autograd on the float64 eager model (its
    softmax kept in float64), and a factor 2 covers the second order. HF's
    loss is itself float32 (it upcasts the logits z to float32 only), on both
    sides: each is off its exact value by at most 2 u max|z| (the logits'
    rounding) + (V + 4) u (the log-sum-exp over V) + 3 u times a token's loss,
    at most 2 max|z| + log V (its subtractions), + N u of the loss (the mean of
    N positive terms: (N - 1) u of it, and the division)."""
    input_ids = torch.randint(0, 61, (2, 19), generator=torch.Generator().manual_seed(0))
    position_ids = packed_position_ids(DOCUMENTS)
    losses = {}
    for impl in ("sdpa", "eager"):
        model = tiny_model("llama", attn_implementation=impl)
        out = model(input_ids=input_ids, position_ids=position_ids, labels=input_ids, use_cache=False)
        losses[impl] = out.loss.item()
        if impl == "sdpa":
            logits = out.logits.detach()
    unpacked = tiny_model("llama")(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    probabilities, softmax = [], torch.nn.functional.softmax

    def kept_float64(scores, dim=-1, dtype=None):
        out = softmax(scores, dim=dim)
        out.retain_grad()
        probabilities.append(out)
        return out

    with mock.patch.object(torch.nn.functional, "softmax", kept_float64):
        tiny_model("llama", attn_implementation="eager")(input_ids=input_ids, position_ids=position_ids,
                                                          labels=input_ids, use_cache=False).loss.backward()
    sensitivity = sum((p.grad * p).abs().sum().item() for p in probabilities)
    z, (vocab_size, tokens) = logits.abs().max().item(), (logits.shape[-1], input_ids.numel())
    float32_loss = UNIT_ROUNDOFF * (2 * z + vocab_size + 4 + 3 * (2 * z + math.log(vocab_size))
                                    + tokens * losses["sdpa"])
    bound = 2 * (input_ids.shape[1] + 3) * UNIT_ROUNDOFF * sensitivity + 2 * float32_loss
    diff = abs(losses["sdpa"] - losses["eager"])
    print(f"HF sdpa {losses['sdpa']:.8f}, eager {losses['eager']:.8f}, one sequence per row {unpacked:.8f}; "
          f"|sdpa - eager| {diff:.2e} (bound {bound:.2e}, {len(probabilities)} softmaxes)")
    assert probabilities and diff <= bound < abs(losses["sdpa"] - unpacked)
    assert abs(losses["sdpa"] - unpacked) > 1e-3


def test_document_starts_follow_hugging_face_rule():
    assert document_starts(packed_position_ids([[3, 1, 2], [6]])) == [[0, 3, 4], [0]]
    # Offsets that keep rising by one are one document; any other step starts one.
    assert document_starts(torch.tensor([[5, 6, 7, 8]])) is None
    assert document_starts(torch.tensor([[0, 1, 1, 2]])) == [[0, 2]]
    assert document_starts(None) is None


def test_documents_with_an_attention_mask_are_refused():
    with pytest.raises(ValueError, match="attention_mask=None"):
        document_starts(packed_position_ids([[3, 3]]), attention_mask=torch.ones(1, 6))


@pytest.mark.parametrize("cu_seq_lens, position_ids, message", [
    ([0, 3, 3, 6], None, "strictly increase"),
    ([0, 3, 5], None, r"batch is \(1, 6\)"),
    ([0, 2, 6], packed_position_ids([[3, 3]]), "disagree"),
])
def test_bad_cu_seq_lens_are_refused(cu_seq_lens, position_ids, message):
    with pytest.raises(ValueError, match=message):
        document_starts(position_ids, cu_seq_lens=torch.tensor(cu_seq_lens), shape=(1, 6))


@pytest.mark.parametrize("token_tile, window", [(0, None), (3, None), (3, 4)])
def test_query_blocks_cover_each_document_causally(token_tile, window):
    """Every local query attends to exactly the keys from its document's start
    to itself: the blocks, expanded, give HF's block-diagonal causal mask; in
    query tiles of at most ``token_tile`` tokens too, and with a sliding
    ``window`` each tile's keys start no later than its first query's window."""
    documents = [[0, 6, 7, 15]]
    seq_len, tsp_size = 24, 4
    positions = packed_position_ids([[6, 1, 8, 9]])[0]
    for layout_name in ("zigzag", "contiguous"):
        for tsp_rank in range(tsp_size):
            local = layout.shard(torch.arange(seq_len).unsqueeze(0), tsp_rank, tsp_size, layout_name)[0]
            (rows, blocks), = query_blocks(documents, seq_len // tsp_size, tsp_rank, tsp_size, layout_name,
                                           token_tile=token_tile, window=window)
            seen = {}
            for q_lo, q_hi, k_lo, k_hi, ahead in blocks:
                assert ahead is None and (token_tile == 0 or q_hi - q_lo <= token_tile)
                for offset, q in enumerate(range(q_lo, q_hi)):
                    # bottom-right causal: query q sees keys k_lo .. its own global index
                    seen[q] = list(range(k_lo, k_hi - (q_hi - q_lo) + offset + 1))
            assert sorted(seen) == list(range(seq_len // tsp_size))
            for q, keys in seen.items():
                token = int(local[q])
                start = token - int(positions[token])
                if window is None:
                    assert keys == list(range(start, token + 1)), (layout_name, tsp_rank, q)
                else:  # the kernel masks the rest of the window; nothing it needs is cut
                    needed = list(range(max(start, token - window + 1), token + 1))
                    assert keys[-len(needed):] == needed and keys[0] >= start, (layout_name, tsp_rank, q)


@pytest.mark.parametrize("token_tile, window", [(0, None), (3, None), (0, 4), (2, 5)])
def test_bidirectional_spans_give_hugging_faces_blockwise_mask(token_tile, window):
    """Gemma 3's mask, block by block: a query sees the keys of its document
    up to itself, and those of its span (one image's tokens) up to the span's
    end, within the window (Hugging Face's AND(window, OR(causal, blockwise)),
    AND its packed documents). Spans straddle chunks, ranks and a document
    start; each rank's blocks, expanded with the kernels' own mask, give
    exactly that mask for every query it holds, in every layout and tiling."""
    seq_len, tsp_size = 32, 4
    marked = torch.zeros(2, seq_len, dtype=torch.bool)
    for row, (start, end) in ((0, (2, 11)), (0, (13, 14)), (0, (18, 29)), (1, (5, 7))):
        marked[row, start:end] = True
    spans = bidirectional_spans(marked)
    assert spans == [[(2, 11), (13, 14), (18, 29)], [(5, 7)]]
    documents = [[0, 22], [0]]  # the last span of row 0 crosses a document start
    for layout_name in ("zigzag", "contiguous"):
        for tsp_rank in range(tsp_size):
            local = layout.shard(torch.arange(seq_len).unsqueeze(0), tsp_rank, tsp_size, layout_name)[0]
            groups = query_blocks(documents, seq_len // tsp_size, tsp_rank, tsp_size, layout_name, batch=2,
                                  token_tile=token_tile, window=window, spans=spans)
            for (rows, blocks), row in zip(groups, (0, 1)):
                seen = {}
                for q_lo, q_hi, k_lo, k_hi, ahead in blocks:
                    assert token_tile == 0 or q_hi - q_lo <= token_tile
                    mask = bottom_right_causal_mask(q_hi - q_lo, k_hi - k_lo, window, ahead=ahead)
                    for offset, q in enumerate(range(q_lo, q_hi)):
                        seen[q] = (mask[offset].nonzero().flatten() + k_lo).tolist()
                assert sorted(seen) == list(range(seq_len // tsp_size))
                for q, keys in seen.items():
                    token = int(local[q])
                    start = max(s for s in documents[row] if s <= token)
                    end = min([s for s in documents[row] if s > token] + [seq_len])
                    span = next(((a, b) for a, b in spans[row] if a <= token < b), (token, token + 1))
                    expected = [j for j in range(start, end) if (j <= token or span[0] <= j < span[1])
                                and (window is None or j > token - window)]
                    assert keys == expected, (layout_name, tsp_rank, row, token)
    assert bidirectional_spans(torch.zeros(2, 4, dtype=torch.bool)) is None
    assert bidirectional_spans(marked[:1], left_padding=torch.tensor([2])) == [[(0, 9), (11, 12), (16, 27)]]


def peak_bytes_of_a_step(documents):
    """Peak live tensor bytes of one forward and backward at D = world size,
    float32, one layer, with the row packing ``documents`` (None: one sequence)."""
    import os
    import sys

    import torch.distributed as dist

    import ds_tsp
    from ds_tsp.config import TSPConfig
    from ds_tsp.parallel.topology import TSPTopology

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from measure import LiveTensorBytes

    tsp_size = dist.get_world_size()
    model = tiny_model("llama", dtype=torch.float32, hidden_size=64, intermediate_size=128, head_dim=16,
                       num_hidden_layers=1)
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size))
    seq_len = sum(documents[0]) if documents else 8192
    input_ids = torch.randint(0, 61, (1, seq_len), generator=torch.Generator().manual_seed(0))
    position_ids = None if documents is None else packed_position_ids(documents)
    with LiveTensorBytes() as live:
        model(input_ids=input_ids, labels=input_ids, position_ids=position_ids).loss.backward()
    return live.peak_bytes - live.state_bytes


def test_packed_documents_cost_no_extra_memory(run_ranks):
    """S = 8192 in four documents (one of length 1) against one sequence, D=2:
    the blocks never build a mask, so the peak stays within 10%."""
    unpacked = max(run_ranks(2, peak_bytes_of_a_step, documents=None))
    packed = max(run_ranks(2, peak_bytes_of_a_step, documents=[[3000, 1, 2191, 3000]]))
    print(f"S=8192, D=2: peak {packed / 2**20:.1f} MiB packed (4 documents), {unpacked / 2**20:.1f} MiB unpacked")
    assert packed <= 1.1 * unpacked
