"""TRL's trainers with TSP: ``TSPSFTTrainer``, ``TSPDPOTrainer``, ``TSPGRPOTrainer``.

Each is ``TSPTrainerMixin`` in front of TRL's class, which keeps its own
data, loss, metrics and reference model; the fused LM head it asks for is
TSP's (per-token log-probabilities from the folded head's ring, no full
logits) and its reference model is TSP-sharded (``ds_tsp.runtime.trl_seams``).
docs/preference.md has the guide.
"""

from trl import DPOTrainer, SFTTrainer

from ds_tsp.config import split_ds_config
from ds_tsp.runtime.trainer import TSPTrainerMixin


class TSPSFTTrainer(TSPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with TSP from the DeepSpeed config's ``tsp`` section."""


class TSPDPOTrainer(TSPTrainerMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with TSP: chosen and rejected rows' log-probability
    sums through the folded head, the reference model TSP-sharded too (given as
    ``ref_model``, or loaded from the policy's path as TRL does)."""

    def __init__(self, model, ref_model=None, args=None, *rest, **kwargs):
        if args is not None and args.precompute_ref_log_probs and _tsp_enabled(args):
            raise ValueError("precompute_ref_log_probs = True: TRL precomputes them through a second DeepSpeed "
                             "engine of the unsharded policy; under TSP leave it False (the reference model is "
                             "TSP-sharded, 1/D of its weights per rank)")
        super().__init__(model, ref_model, args, *rest, **kwargs)


def _tsp_enabled(args):
    """Whether the arguments' DeepSpeed config has TSP on."""
    config = args.hf_deepspeed_config.config if getattr(args, "hf_deepspeed_config", None) else None
    return config is not None and split_ds_config(config)[1].enabled
