import pytest
from parity import check, model_parity


@pytest.mark.parametrize("D", [1, 2])
def test_bamba(run_ranks, D):
    check(run_ranks(D, model_parity, arch="bamba", batch=2, seq_len=24, relative=True), f"D={D} bamba")
