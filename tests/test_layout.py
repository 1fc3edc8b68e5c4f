import pytest
import torch

from ds_tsp.parallel import layout

SIZES = range(1, 9)


@pytest.mark.parametrize("name", layout.LAYOUTS)
@pytest.mark.parametrize("tsp_size", SIZES)
def test_shard_then_unshard_is_identity(name, tsp_size):
    for seq_len in (2 * tsp_size, 4 * tsp_size, 6 * tsp_size, 16 * tsp_size):
        x = torch.randn(2, seq_len, 3)
        shards = torch.stack([layout.shard(x, r, tsp_size, name) for r in range(tsp_size)])
        assert shards.shape == (tsp_size, 2, seq_len // tsp_size, 3)
        assert torch.equal(layout.unshard(shards, tsp_size, name), x)
        assert torch.equal(layout.stack_shards(x, tsp_size, name), shards)


@pytest.mark.parametrize("name", layout.LAYOUTS)
@pytest.mark.parametrize("tsp_size", SIZES)
def test_positions_are_the_tokens_global_indices(name, tsp_size):
    seq_len = 8 * tsp_size
    tokens = torch.arange(seq_len).unsqueeze(0) * 10
    owned = []
    for r in range(tsp_size):
        pos = layout.positions(r, tsp_size, name, seq_len)
        assert torch.equal(layout.shard(tokens, r, tsp_size, name)[0], pos * 10)
        owned += pos.tolist()
    assert sorted(owned) == list(range(seq_len))


def test_zigzag_chunks_balance_causal_work():
    tsp_size = 4
    work = [sum(c + 1 for c in layout.chunk_ids(r, tsp_size, "zigzag")) for r in range(tsp_size)]
    assert work == [2 * tsp_size + 1] * tsp_size
    assert layout.chunk_ids(1, 4, "zigzag") == [1, 6]
    assert layout.chunk_ids(1, 4, "contiguous") == [2, 3]


@pytest.mark.parametrize("tsp_size", SIZES)
def test_padding_is_reported_and_undone(tsp_size):
    for seq_len in range(1, 5 * tsp_size):
        x = torch.arange(seq_len).unsqueeze(0)
        padded, num_padding = layout.pad_to_multiple(x, tsp_size, value=-1)
        assert padded.shape[1] % (2 * tsp_size) == 0
        assert padded.shape[1] - seq_len == num_padding < 2 * tsp_size
        mask = layout.real_token_mask(seq_len, num_padding)
        assert torch.equal(padded[0, ~mask], torch.full((num_padding,), -1))
        assert torch.equal(layout.unpad(padded, num_padding), x)


def test_a_length_the_layout_cannot_take_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 2\\*tsp.size = 8"):
        layout.shard(torch.zeros(1, 12), 0, 4, "zigzag")
    with pytest.raises(ValueError, match="unknown layout 'spiral'"):
        layout.chunk_ids(0, 2, "spiral")
