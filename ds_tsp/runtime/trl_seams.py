"""The two seams of TRL's trainers that TSP takes over (``TSPTrainerMixin``).

TRL's trainers (SFT, DPO, GRPO, RLOO, KTO) call, while they are built,
``add_fused_lm_head`` on the policy and the reference model, and
``prepare_deepspeed`` on the reference model. Under TSP:

* ``add_fused_lm_head`` becomes ``ds_tsp.add_fused_lm_head``: the model's
  ``fused_lm_head=True`` forward then gives TRL's per-token fields from the
  folded head's ring (``ds_tsp.injection.scores``), so the trainer's own loss
  (DPO's, GRPO's, SFT's) runs unchanged on the TSP model;
* ``prepare_deepspeed`` of a reference model injects TSP into it over the
  trainer's TSP group (each rank holds ``1/D`` of its weights, as the policy
  does; frozen, in evaluation mode) instead of building a DeepSpeed engine of
  the whole model.

Each is replaced in the modules of the trainer's TRL classes, for the
duration of the trainer's ``__init__`` only.
"""

import contextlib
import sys

from ds_tsp.injection.inject import inject
from ds_tsp.injection.model import TSPCausalLMMixin
from ds_tsp.injection.scores import add_fused_lm_head


@contextlib.contextmanager
def trl_seams_replaced(trainer):
    """While the body runs, TRL's ``add_fused_lm_head`` and ``prepare_deepspeed``
    as seen by ``trainer``'s classes are the TSP ones whenever the trainer
    turned out to run TSP (``trainer.tsp_topology``, set by the Trainer's
    ``create_accelerator_and_postprocess``, which runs first)."""
    replaced = []
    for cls in type(trainer).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is None or not cls.__module__.startswith("trl."):
            continue
        for name, tsp_version in (("add_fused_lm_head", _tsp_fused_lm_head), ("prepare_deepspeed", _tsp_reference)):
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "tsp_seam", False):
                replaced.append((module, name, original))
                setattr(module, name, _either(trainer, original, tsp_version))
    try:
        yield
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)


def _either(trainer, original, tsp_version):
    def seam(model, *args, **kwargs):
        if trainer.tsp_topology is None:
            return original(model, *args, **kwargs)
        return tsp_version(trainer, model, *args, **kwargs)

    seam.tsp_seam = True
    return seam


def _tsp_fused_lm_head(trainer, model, *args, **kwargs):
    add_fused_lm_head(model, *args, **kwargs)


def _tsp_reference(trainer, model, accelerator):
    """The reference model, TSP-injected over the trainer's TSP group, frozen and in evaluation mode."""
    if not isinstance(model, TSPCausalLMMixin):
        model = inject(model, trainer.tsp_topology, trainer.tsp_config, device=accelerator.device)
    model.to(accelerator.device)
    model.requires_grad_(False)
    return model.eval()
