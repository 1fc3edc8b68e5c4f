"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed and Hugging Face decoder models.

The names that need DeepSpeed load on first use, so that the blocks alone
(``ds_tsp.attention``, ``ds_tsp.mlp``, ``ds_tsp.inject``) import on a machine
without it, e.g. a GPU box running ``benchmarks/block_overhead.py``.
"""

import importlib

# Bound eagerly: the function shares its name with its module, and a lazy
# lookup would return the module once something imported ``ds_tsp.inject``.
from .inject import inject

_EXPORTS = {"TSPConfig": "config", "TSPConfigError": "config", "TSPTopology": "topology", "initialize": "engine",
            "num_items_in_batch": "engine", "from_pretrained": "checkpoint", "save_pretrained": "checkpoint",
            "TSPTrainer": "trainer", "TSPTrainerMixin": "trainer"}

__all__ = sorted([*_EXPORTS, "inject"])


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_tsp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
