"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed and Hugging Face decoder models.

The public names load on first use, so that ``import ds_tsp.attention`` (the
blocks alone, e.g. on a GPU box without DeepSpeed) does not import DeepSpeed.
"""

import importlib

_EXPORTS = {
    "TSPConfig": "config", "TSPConfigError": "config", "TSPTopology": "topology",
    "initialize": "engine", "inject": "inject",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_tsp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
