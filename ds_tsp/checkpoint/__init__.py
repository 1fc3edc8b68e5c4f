"""Checkpoints: Hugging Face safetensors in, TSP shards out of them, and back.

Three floors, imported one way only: ``shard_plan`` (which piece of which tensor
every TSP rank holds, from sizes alone) and ``expert_files`` (transformers'
per-expert file names of sparse-MoE experts against the fused tensors the
model holds) <- ``reading`` (Hugging Face and ``ds-tsp convert`` directories,
``from_pretrained``) <- ``writing`` (gathering, ``save_pretrained``,
``ds-tsp convert``).
"""

from ds_tsp.checkpoint.formats import CheckpointError
from ds_tsp.checkpoint.reading import SafetensorsCheckpoint, TSPShardCheckpoint, from_pretrained, open_checkpoint
from ds_tsp.checkpoint.shard_plan import layer_shards, meta_model, shard_plan
from ds_tsp.checkpoint.writing import join_checkpoint, save_pretrained, shard_checkpoint

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "TSPShardCheckpoint", "from_pretrained", "join_checkpoint",
           "layer_shards", "meta_model", "open_checkpoint", "save_pretrained", "shard_checkpoint", "shard_plan"]
