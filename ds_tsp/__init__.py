"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed and Hugging Face decoder models.

The package is built in floors, each importing only the ones below it:
``config`` and ``planning`` (the cost model, no torch), ``parallel``
(collectives and layouts), ``blocks`` (the TSP attention, MLP, experts and
vocabulary; no DeepSpeed), ``inference``, ``injection`` (Hugging Face model
rewriting), ``checkpoint``, ``runtime`` (the DeepSpeed engine and the Trainer),
``cli``. The public names below load on first use, so ``import ds_tsp`` costs
nothing and ``ds_tsp.blocks`` imports without DeepSpeed. docs/api.md says
which paths are public.
"""

import importlib
import importlib.machinery
import sys
import types
import warnings

_EXPORTS = {"TSPConfig": "config", "TSPConfigError": "config", "TSPTopology": "parallel.topology",
            "initialize": "runtime.engine", "num_items_in_batch": "runtime.engine", "inject": "injection.inject",
            "from_pretrained": "checkpoint", "save_pretrained": "checkpoint", "TSPTrainer": "runtime.trainer",
            "TSPTrainerMixin": "runtime.trainer", "configure_cpu_ranks": "runtime.trainer",
            "argmax_token_ids": "runtime.trainer", "sequence_sums": "injection.scores",
            "natural_order": "injection.scores", "add_fused_lm_head": "injection.scores",
            "TSPSFTTrainer": "runtime.trl_trainers", "TSPDPOTrainer": "runtime.trl_trainers",
            "TSPGRPOTrainer": "runtime.trl_trainers", "layer_graph_breaks": "runtime.graph_breaks"}

__all__ = sorted(_EXPORTS)

# The flat layout's module paths before the regroup into floors, each imported as the module it became.
# Deprecated in 0.1; removed in 0.2.0.
_MOVED = {
    "ds_tsp.amp": "ds_tsp.parallel.amp", "ds_tsp.comm": "ds_tsp.parallel.comm",
    "ds_tsp.layout": "ds_tsp.parallel.layout", "ds_tsp.mappings": "ds_tsp.parallel.mappings",
    "ds_tsp.ring": "ds_tsp.parallel.ring", "ds_tsp.topology": "ds_tsp.parallel.topology",
    "ds_tsp.attention": "ds_tsp.blocks.attention.module", "ds_tsp.attention_kernels": "ds_tsp.blocks.attention.kernels",
    "ds_tsp.attention_selection": "ds_tsp.blocks.attention.selection",
    "ds_tsp.head_groups": "ds_tsp.blocks.attention.head_groups", "ds_tsp.moe": "ds_tsp.blocks.moe.module",
    "ds_tsp.documents": "ds_tsp.blocks.documents", "ds_tsp.fused": "ds_tsp.blocks.fused",
    "ds_tsp.input_norm": "ds_tsp.blocks.input_norm", "ds_tsp.mlp": "ds_tsp.blocks.mlp",
    "ds_tsp.packing": "ds_tsp.blocks.packing", "ds_tsp.rotary": "ds_tsp.blocks.rotary",
    "ds_tsp.vocab": "ds_tsp.blocks.vocab",
    "ds_tsp.generate": "ds_tsp.inference.generate", "ds_tsp.kv_cache": "ds_tsp.inference.kv_cache",
    "ds_tsp.consistency": "ds_tsp.injection.consistency", "ds_tsp.inject": "ds_tsp.injection.inject",
    "ds_tsp.lora": "ds_tsp.injection.lora", "ds_tsp.model": "ds_tsp.injection.model",
    "ds_tsp.pipeline": "ds_tsp.injection.pipeline", "ds_tsp.policy": "ds_tsp.injection.policy",
    "ds_tsp.probe": "ds_tsp.injection.probe",
    "ds_tsp.export": "ds_tsp.checkpoint.export", "ds_tsp.checkpoint.planning": "ds_tsp.checkpoint.shard_plan",
    "ds_tsp.engine": "ds_tsp.runtime.engine", "ds_tsp.offload": "ds_tsp.runtime.offload",
    "ds_tsp.optimizer": "ds_tsp.runtime.optimizer", "ds_tsp.prefetch": "ds_tsp.runtime.prefetch",
    "ds_tsp.replicated_schedule": "ds_tsp.runtime.replicated_schedule", "ds_tsp.trainer": "ds_tsp.runtime.trainer",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_tsp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


class _MovedModules:
    """Meta-path finder and loader: an old path in ``_MOVED`` imports as its new module itself (the same
    objects, one copy), with a DeprecationWarning naming the new path. Nothing loads before it is asked for."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in _MOVED else None

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the new module in its place in sys.modules

    def exec_module(self, module):
        old, new = module.__name__, _MOVED[module.__name__]
        # stacklevel 2 skips the import system's frames, so the warning names the importing line.
        warnings.warn(f"{old} is deprecated and will be removed in ds_tsp 0.2.0: import from {new}",
                      DeprecationWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # The import system binds a loaded submodule on its package: the old module ds_tsp.inject must not
        # replace the function ds_tsp.inject.
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


class _GRPOConfigCountingReplicas:
    """Meta-path finder: TRL's GRPO config module, when it loads, gets its batch arithmetic counted in
    data-parallel replicas under TSP (``runtime.trl_config``), which must be in place before a config is built."""

    MODULE = "trl.trainer.grpo_config"

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path, target) if name == self.MODULE else None
        if spec is not None and spec.loader is not None:
            loader_exec = spec.loader.exec_module

            def exec_module(module):
                loader_exec(module)
                _count_replicas(module)

            spec.loader.exec_module = exec_module  # this module's loader, made for this spec
        return spec


def _count_replicas(grpo_config_module):
    importlib.import_module(".runtime.trl_config", __name__).count_replicas(grpo_config_module.GRPOConfig)


sys.modules[__name__].__class__ = _Package
sys.meta_path.append(_MovedModules())
if _GRPOConfigCountingReplicas.MODULE in sys.modules:
    _count_replicas(sys.modules[_GRPOConfigCountingReplicas.MODULE])
else:
    sys.meta_path.insert(0, _GRPOConfigCountingReplicas())
