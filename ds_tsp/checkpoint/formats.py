"""What a checkpoint directory holds: the file names of Hugging Face's
weights and indexes, of PEFT's adapters and of ``ds-tsp convert``'s per-rank
shards, which of them a reader takes first, ``CheckpointError`` and
``open_safetensors``, which names the file a failed opening was of."""

import os
import re

from safetensors import SafetensorError, safe_open

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
TSP_SHARDS = "tsp_shards.json"
TSP_SHARDS_FORMAT = "ds_tsp.tsp_shards"
# Hugging Face's order of preference (transformers' ``_get_resolved_checkpoint_files``).
HF_WEIGHTS_ORDER = (SAFE_WEIGHTS, SAFE_WEIGHTS_INDEX, TORCH_WEIGHTS, TORCH_WEIGHTS_INDEX)
# Every file of a checkpoint, whatever its layout: Hugging Face weights (single,
# sharded "-00001-of-00002", with a variant "model.fp16.safetensors"), their
# indexes, and ds-tsp convert's per-rank files and description.
_CHECKPOINT_FILE = re.compile(r"(model|pytorch_model)([.-][^/]*)?\.(safetensors|bin)"
                              r"|(model\.safetensors|pytorch_model\.bin)\.index(\.[^/]+)?\.json"
                              r"|rank\d+-of-\d+\.safetensors|" + re.escape(TSP_SHARDS))


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or the request; the message names the file and the fix."""


def rank_file(tsp_rank, tsp_size):
    return f"rank{tsp_rank}-of-{tsp_size}.safetensors"


def is_checkpoint_file(name):
    """Whether ``name`` is a checkpoint file: weights, an index, a TSP shard file or description."""
    return _CHECKPOINT_FILE.fullmatch(name) is not None


def checkpoint_files(directory):
    """The names of the checkpoint files (weights, indexes, TSP shards) in
    ``directory``, sorted; empty when it does not exist."""
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory)
                  if is_checkpoint_file(name) and os.path.isfile(os.path.join(directory, name)))


def hf_weights_file(directory):
    """The weights file Hugging Face's ``from_pretrained`` would read in
    ``directory`` (see ``HF_WEIGHTS_ORDER``), or None."""
    return next((name for name in HF_WEIGHTS_ORDER if os.path.isfile(os.path.join(directory, name))), None)


def open_safetensors(file):
    """``safe_open(file)``; a missing, truncated or corrupt file is a
    ``CheckpointError`` that names it (safetensors' own message does not)."""
    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist (named by the checkpoint's index?): the checkpoint is "
                              "incomplete; download or save it again") from None
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file} cannot be read as safetensors ({error}): it is truncated or corrupt; "
                              "download or save it again") from None
