"""Mamba-2 hybrids (Bamba) under TSP against the unsharded Hugging Face model, float64, with Hugging Face's float32
casts of the scan widened to float64 (tests/models.py)."""

from unittest import mock

import pytest

from ds_tsp.blocks.linear import recurrence
from parity import check, check_caught, model_parity

# Right- and left-padded, packed (documents restarting the positions: every state restarts at each, and the
# convolution's window stops there) and many 8-token SSM chunks (45 tokens: chunks of 5 or 6 tokens a rank at D = 4,
# not a multiple of the SSM chunk).
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=16, left_padding=5),
         dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]), dict(batch=1, seq_len=45))
ARCHS = ("bamba",)


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_mamba2_hybrids_match_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient, relative to the largest entry of the reference's where it is above 1."""
    for arch in ARCHS:
        for case in CASES:
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, **case), f"D={tsp_size} {arch} {case}")


def _wrong_map(**kwargs):
    """``model_parity`` with every chunk's state map off by 1% (its ``U``), as exchanged."""
    gather_maps = recurrence.gather_maps

    def wrong(*args):
        return [(T, U * 1.01) for T, U in gather_maps(*args)]

    with mock.patch.object(recurrence, "gather_maps", wrong), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def _no_halo(**kwargs):
    """``model_parity`` with the convolution's halos dropped (zeros before every chunk)."""
    def no_halos(x, group, layout_name, width):
        return [x.new_zeros(x.shape[0], width, x.shape[2])] * 2

    with mock.patch("ds_tsp.blocks.linear.conv.halos", no_halos), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def test_a_wrong_map_halo_or_shard_is_caught(run_ranks):
    for label, body, kwargs in (("chunk map 1% off", _wrong_map, {}), ("halo dropped", _no_halo, {}),
                                ("head group scaled", model_parity, {"wrong_shard": "model.layers.0.mamba"})):
        check_caught(run_ranks(2, body, arch="bamba", batch=2, seq_len=13, relative=True, **kwargs), label)
