import os

import pytest

from distributed import RankPools

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def rank_pools():
    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture
def run_ranks(rank_pools):
    """``run_ranks(world_size, body, **kwargs)`` runs ``body(**kwargs)`` on that many
    gloo ranks and returns the per-rank results."""
    return rank_pools.run
