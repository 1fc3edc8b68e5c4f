"""``tsp.prefetch_checkpoints: "auto"``: bring offloaded checkpoints back early where the device can afford it.

With ``cpu_checkpointing`` every layer's input waits for backward in host
memory (``ds_tsp.runtime.offload``). Prefetching starts the copy back of the layer
below's input when a layer's backward starts, so the copy runs under that
backward instead of before the next one, at the cost of one more layer input
``(B, S/D, H)`` on the device. "auto" prefetches when the planner
(``ds_tsp.planning``) puts this run's peak, at the micro-batch's shape and
with that one more input, within the device's memory; at the longest
sequences, where the planner's peak has no room for it, the copy back waits
for the layer's own backward. Decided once per micro-batch shape; on devices
without a side stream to copy on (CPU) there is nothing to overlap and it
never prefetches.
"""

import torch
from deepspeed.utils import logger

from ds_tsp.planning import model_shape
from ds_tsp.planning.strategies import make_setting
from ds_tsp.planning.tsp_plan import plan_tsp

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def cuda_memory(device):
    """Total memory of a CUDA ``device`` in bytes; None for other devices."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


class PrefetchWhenAffordable:
    """``prefetch(hidden)`` for ``ds_tsp.runtime.offload.host_checkpoint``: whether the
    planner's peak of this run, for micro-batches of ``hidden``'s shape (the
    local tokens ``(B, S/D, H)``), fits ``device_memory(device)`` with one more
    checkpointed layer input on the device. ``run``: the planner's keyword
    arguments that describe the run (ZeRO stage, offloads, the ``tsp`` keys)."""

    def __init__(self, config, tsp_size, vocab_parallel, run, device_memory=cuda_memory):
        self.config, self.tsp_size, self.vocab_parallel, self.run = config, tsp_size, vocab_parallel, run
        self.device_memory = device_memory
        self.decided = {}

    def __call__(self, hidden):
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if key not in self.decided:
            self.decided[key] = self._affordable(hidden)
        return self.decided[key]

    def _affordable(self, hidden):
        memory = self.device_memory(hidden.device)
        if memory is None or hidden.dtype not in _DTYPES:
            return False
        try:
            shape = model_shape(self.config)
        except ValueError as exc:  # a family the planner does not model
            logger.warning(f"tsp.prefetch_checkpoints \"auto\" does not prefetch: the planner cannot model "
                           f"this model ({exc}); set it to true to prefetch anyway")
            return False
        batch, local_tokens = hidden.shape[:2]
        setting = make_setting(shape, local_tokens * self.tsp_size, batch, self.tsp_size, _DTYPES[hidden.dtype],
                               activation_checkpointing=True, offload_activations=True, prefetch_checkpoints=True,
                               **self.run)
        planned = plan_tsp(setting, vocab_parallel=self.vocab_parallel).total
        return planned <= memory
