"""TRL's trainers with TSP: ``TSPSFTTrainer``, ``TSPDPOTrainer``, ``TSPGRPOTrainer``.

Each is ``TSPTrainerMixin`` in front of TRL's class, which keeps its own
data, loss, metrics and reference model; the fused LM head it asks for is
TSP's (per-token log-probabilities from the folded head's ring, no full
logits) and its reference model is TSP-sharded (``ds_tsp.runtime.trl_seams``).
docs/preference.md has the guide.
"""

import contextlib

from accelerate.utils import gather_object, set_seed
from trl import DPOTrainer, GRPOTrainer, SFTTrainer
from trl.trainer import grpo_trainer

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


class TSPGRPOTrainer(TSPTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with TSP: completions sampled by HF's ``generate``
    on the TSP model (a sequence-sharded cache, every rank of a TSP group
    drawing the same tokens), their log-probabilities through the folded head,
    the reference model TSP-sharded. TRL's generation batch, advantages and
    loss normalizers count data-parallel replicas, not ranks: a TSP group is
    one replica (``generation_batch_size`` becomes ``per_device_train_batch_size
    x data-parallel size x steps_per_generation``, each replica seeded
    ``seed + its data-parallel rank``). vLLM and transformers' continuous
    batching generate from an unsharded copy of the policy and are refused, as
    is ZeRO-3, whose partitioned shards TSP generation cannot read."""

    def __init__(self, model, reward_funcs, args=None, *rest, **kwargs):
        if args is not None and _tsp_enabled(args):
            _refuse_what_tsp_generation_cannot_serve(args)
            _generation_batch_per_replica(args)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if self.tsp_topology is not None:  # TRL seeded each rank apart: each replica instead, its TSP ranks alike
            set_seed(self.args.seed + self.tsp_topology.dp_rank)

    def _generate_and_score_completions(self, inputs):
        with self._data_parallel_view():
            return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        with self._data_parallel_view():
            return super()._compute_loss(model, inputs)

    @contextlib.contextmanager
    def _data_parallel_view(self):
        """While TRL slices, gathers and normalizes its generation batch: the
        accelerator's processes are the data-parallel replicas (one copy of each
        TSP group's rows), and so are those of the gathers TRL imports."""
        if self.tsp_topology is None:
            yield
            return
        accelerator = self.accelerator
        replaced = {"gather": accelerator.gather, "gather_object": _objects_of_each_replica(self.tsp_topology)}
        originals = {name: getattr(grpo_trainer, name) for name in replaced}
        with accelerator.data_parallel_view():
            for name, function in replaced.items():
                setattr(grpo_trainer, name, function)
            try:
                yield
            finally:
                for name, function in originals.items():
                    setattr(grpo_trainer, name, function)


def _refuse_what_tsp_generation_cannot_serve(args):
    for option in ("use_vllm", "use_transformers_continuous_batching"):
        if getattr(args, option, False):
            raise ValueError(f"{option} = True: it generates from an unsharded copy of the policy; leave it False "
                             "under TSP, where Hugging Face's generate runs on the TSP model (a sequence-sharded "
                             "KV cache, 1/D of the weights a rank)")
    if args.hf_deepspeed_config.is_zero3():
        raise ValueError("zero_optimization.stage 3: GRPO samples completions from the policy every generation "
                         "batch, and TSP generation reads the shards at rest, which ZeRO-3 keeps partitioned over "
                         "the data-parallel ranks: use stage 0-2 with TSPGRPOTrainer (TSP already holds 1/D of the "
                         "weights a rank; ZeRO-1/2 partition the optimizer states and gradients)")


def _generation_batch_per_replica(args):
    """TRL derives ``generation_batch_size`` from the world size; under TSP the
    ranks of a group share their rows: per device x data-parallel size x
    steps_per_generation."""
    tsp_size = split_ds_config(args.hf_deepspeed_config.config)[1].size
    dp_size = max(args.world_size // tsp_size, 1)
    args.generation_batch_size = args.per_device_train_batch_size * dp_size * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise ValueError(f"generation_batch_size = {args.generation_batch_size} (per_device_train_batch_size "
                         f"{args.per_device_train_batch_size} x data-parallel size {dp_size} x steps_per_generation "
                         f"{args.steps_per_generation} under tsp.size {tsp_size}) must be divisible by "
                         f"num_generations = {args.num_generations}: raise steps_per_generation or the batch size")


def _objects_of_each_replica(topology):
    """``accelerate.utils.gather_object`` keeping one copy of each TSP group's objects."""

    def gather(objects):
        per_rank = gather_object([objects])
        return [item for rank, part in enumerate(per_rank) if rank % topology.tsp_size == 0 for item in part]

    return gather


def _tsp_enabled(args):
    """Whether the arguments' DeepSpeed config has TSP on."""
    config = args.hf_deepspeed_config.config if getattr(args, "hf_deepspeed_config", None) else None
    return config is not None and split_ds_config(config)[1].enabled
