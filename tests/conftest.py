import gc
import os
from pathlib import Path

import pytest

from distributed import RankPools, forkserver_context

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("quick", "all"), default="all",
                     help="quick: the tests tests/quick_tier.py names (make test); all: the whole suite (make test-all)")


def pytest_configure(config):
    """Start the rank workers' fork server now: its imports (about 8 s) run
    beside the collection of the tests instead of before the first rank test."""
    forkserver_context()


def pytest_collection_modifyitems(config, items):
    """Under ``--tier quick``, keep only the tests ``QUICK_TIER`` names; an entry
    that names no collected test is an error, not a silent gap."""
    if config.getoption("tier") != "quick":
        return
    from quick_tier import QUICK_TIER

    def named_by(item, entry):
        path, _, test = entry.partition("::")
        if item.path.name != path:
            return False
        return not test or item.name == test or item.originalname == test

    collected = {item.path.name for item in items}
    unmatched = [entry for entry in QUICK_TIER if not (Path(__file__).parent / entry.partition("::")[0]).exists()
                 or entry.partition("::")[0] in collected and not any(named_by(item, entry) for item in items)]
    if unmatched and not config.getoption("keyword") and not config.getoption("markexpr"):
        raise pytest.UsageError(f"tests/quick_tier.py names tests that do not exist: {unmatched}")
    kept = [item for item in items if any(named_by(item, entry) for entry in QUICK_TIER)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


# DeepSpeed's shared-memory all-reduce (the CPU accelerator's, where the TSP group is the whole world) opens these
# in /dev/shm and never unlinks them: 69 MB each, tens a run, held in the machine's memory until removed.
SHARED_MEMORY = Path("/dev/shm")
SHARED_BUFFERS = "deepspeed_allreduce_buffer_*"


def pytest_sessionstart(session):
    session.config.shared_buffers_before = set(SHARED_MEMORY.glob(SHARED_BUFFERS))


def pytest_sessionfinish(session):
    """Remove the shared-memory buffers this session's ranks left, not another's."""
    for path in set(SHARED_MEMORY.glob(SHARED_BUFFERS)) - session.config.shared_buffers_before:
        path.unlink(missing_ok=True)


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
