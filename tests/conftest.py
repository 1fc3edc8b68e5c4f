import gc
import os

import pytest

from distributed import RankPools, forkserver_context

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_configure(config):
    """Start the rank workers' fork server now: its imports (about 8 s) run
    beside the collection of the tests instead of before the first rank test."""
    forkserver_context()


def pytest_collection_finish(session):
    """The collected test modules and what they imported live for the whole
    session: out of the garbage collector's sight (as in the rank workers),
    full collections walk only what the tests make."""
    gc.freeze()


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


@pytest.fixture
def own_processes(rank_pools):
    """For a test that starts its own processes (the deepspeed launcher, a
    benchmark): the rank pools close first, so their idle workers, and the
    gloo threads of the groups earlier tests destroyed (a gloo group's threads
    outlive destroy_process_group), do not compete with it for the cores. The
    next test that needs ranks starts fresh pools."""
    rank_pools.close()
