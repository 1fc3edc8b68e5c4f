"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed and Hugging Face decoder models."""

from .config import TSPConfig, TSPConfigError
from .engine import initialize
from .inject import inject
from .topology import TSPTopology

__all__ = ["TSPConfig", "TSPConfigError", "TSPTopology", "initialize", "inject"]
