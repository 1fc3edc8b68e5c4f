"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed and Hugging Face decoder models.

The package is built in floors, each importing only the ones below it:
``config`` and ``planning`` (the cost model, no torch), ``parallel``
(collectives and layouts), ``blocks`` (the TSP attention, MLP, experts and
vocabulary; no DeepSpeed), ``inference``, ``injection`` (Hugging Face model
rewriting), ``checkpoint``, ``runtime`` (the DeepSpeed engine and the Trainer),
``cli``. The public names below load on first use, so ``import ds_tsp`` costs
nothing and ``ds_tsp.blocks`` imports without DeepSpeed.
"""

import importlib

_EXPORTS = {"TSPConfig": "config", "TSPConfigError": "config", "TSPTopology": "parallel.topology",
            "initialize": "runtime.engine", "num_items_in_batch": "runtime.engine", "inject": "injection.inject",
            "from_pretrained": "checkpoint", "save_pretrained": "checkpoint", "TSPTrainer": "runtime.trainer",
            "TSPTrainerMixin": "runtime.trainer", "configure_cpu_ranks": "runtime.trainer",
            "argmax_token_ids": "runtime.trainer", "sequence_sums": "injection.scores",
            "natural_order": "injection.scores", "add_fused_lm_head": "injection.scores",
            "TSPSFTTrainer": "runtime.trl_trainers", "TSPDPOTrainer": "runtime.trl_trainers",
            "TSPGRPOTrainer": "runtime.trl_trainers"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_tsp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
