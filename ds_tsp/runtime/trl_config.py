"""TRL's ``GRPOConfig`` under TSP: its batch arithmetic counts data-parallel replicas.

``GRPOConfig.__post_init__`` derives ``generation_batch_size`` and
``steps_per_generation`` from each other, and checks them and the evaluation
batch, by ``world_size``: the ranks. The ranks of a TSP group share their rows,
one data-parallel replica. While ``__post_init__`` runs on a config whose
DeepSpeed config has a ``tsp`` section, ``world_size`` counts replicas, so each
of these fields, set or derived, means what it means under data parallelism
over as many replicas, TRL's own checks and messages included.

The user's values are gone once ``__post_init__`` has run (an explicit
``generation_batch_size`` and the ``steps_per_generation`` it implies leave the
same config), so this has to be in place before the config is built: ``import
ds_tsp`` puts it there, at once if TRL's config module is loaded, else when it
is. ``TSPGRPOTrainer`` refuses a config that counted ranks.
"""

import functools

_COUNTING_REPLICAS = {}


def count_replicas(config_class):
    """Make ``config_class.__post_init__`` (TRL's ``GRPOConfig``'s) see
    ``world_size`` in data-parallel replicas under TSP; once only."""
    original = config_class.__post_init__
    if getattr(original, "tsp_counts_replicas", False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        built_as = type(self)
        self.__class__ = _counting_replicas(built_as)
        try:
            original(self)
        finally:
            self.__class__ = built_as

    __post_init__.tsp_counts_replicas = True
    config_class.__post_init__ = __post_init__


class _ReplicaCount:
    @property
    def world_size(self):
        """The ranks, or the data-parallel replicas once the DeepSpeed plugin
        (which ``TrainingArguments.__post_init__`` sets up last, before TRL's
        derivations) holds an enabled ``tsp`` section dividing them."""
        ranks = super().world_size
        plugin = getattr(self, "deepspeed_plugin", None)
        if plugin is None:
            return ranks
        from ds_tsp.config import split_ds_config

        tsp_config = split_ds_config(plugin.deepspeed_config)[1]
        return ranks // tsp_config.size if tsp_config.enabled and ranks % tsp_config.size == 0 else ranks


def _counting_replicas(cls):
    if cls not in _COUNTING_REPLICAS:
        _COUNTING_REPLICAS[cls] = type(cls.__name__, (_ReplicaCount, cls), {})
    return _COUNTING_REPLICAS[cls]
