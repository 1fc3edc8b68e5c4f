"""TRL's trainers with TSP: ``TSPSFTTrainer``, ``TSPDPOTrainer``, ``TSPGRPOTrainer``.

Each is ``TSPTrainerMixin`` in front of TRL's class, which keeps its own
data, loss, metrics and reference model; the fused LM head it asks for is
TSP's (per-token log-probabilities from the folded head's ring, no full
logits) and its reference model is TSP-sharded (``ds_tsp.runtime.trl_seams``),
or, with a ``peft_config``, the policy with its sharded adapters switched off
(``ds_tsp.injection.lora.adapters_disabled``). docs/preference.md has the guide.
"""

import contextlib

from accelerate.utils import gather_object, set_seed
from trl import DPOTrainer, GRPOTrainer, SFTTrainer
from trl.trainer import grpo_trainer

from ds_tsp.config import split_ds_config
from ds_tsp.injection.lora import is_peft_model
from ds_tsp.runtime.trainer import TSPTrainerMixin


class TSPSFTTrainer(TSPTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with TSP from the DeepSpeed config's ``tsp`` section."""


class TSPDPOTrainer(TSPTrainerMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with TSP: chosen and rejected rows' log-probability
    sums through the folded head, the reference model TSP-sharded too (given as
    ``ref_model``, or loaded from the policy's path as TRL does)."""

    def __init__(self, model, ref_model=None, args=None, *rest, **kwargs):
        if args is not None and args.precompute_ref_log_probs and _tsp_section(args).enabled:
            raise ValueError("precompute_ref_log_probs = True: TRL precomputes them through a second DeepSpeed "
                             "engine of the unsharded policy; under TSP leave it False (the reference model is "
                             "TSP-sharded, 1/D of its weights per rank)")
        super().__init__(model, ref_model, args, *rest, **kwargs)
        _refuse_a_second_adapter(self)


class TSPGRPOTrainer(TSPTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with TSP: completions sampled by HF's ``generate``
    on the TSP model (a sequence-sharded cache, every rank of a TSP group
    drawing the same tokens), their log-probabilities through the folded head,
    the reference model TSP-sharded (or, with a ``peft_config``, the policy
    with its adapters off). TRL's generation batch, advantages and loss
    normalizers count data-parallel replicas, not ranks: a TSP group is one
    replica (``GRPOConfig``'s ``generation_batch_size`` and
    ``steps_per_generation`` as under data parallelism,
    ``ds_tsp.runtime.trl_config``; each replica seeded ``seed + its
    data-parallel rank``). vLLM and transformers' continuous
    batching generate from an unsharded copy of the policy and are refused, as
    is ZeRO-3, whose partitioned shards TSP generation cannot read."""

    def __init__(self, model, reward_funcs, args=None, *rest, **kwargs):
        if args is not None and _tsp_section(args).enabled:
            _refuse_what_tsp_generation_cannot_serve(args)
            _check_batches_count_replicas(args)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        _refuse_a_second_adapter(self)
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
    if args.deepspeed_plugin.zero_stage == 3:
        raise ValueError("zero_optimization.stage 3: GRPO samples completions from the policy every generation "
                         "batch, and TSP generation reads the shards at rest, which ZeRO-3 keeps partitioned over "
                         "the data-parallel ranks: use stage 0-2 with TSPGRPOTrainer (TSP already holds 1/D of the "
                         "weights a rank; ZeRO-1/2 partition the optimizer states and gradients)")


def _check_batches_count_replicas(args):
    """Refuse a ``GRPOConfig`` whose batch arithmetic counted ranks: one built
    before ``import ds_tsp`` (``ds_tsp.runtime.trl_config``), or changed after."""
    tsp_size = _tsp_section(args).size
    dp_size = max(args.world_size // tsp_size, 1)  # outside GRPOConfig.__post_init__, world_size counts ranks
    per_step = args.per_device_train_batch_size * args.steps_per_generation
    if args.generation_batch_size != per_step * dp_size:
        raise ValueError(f"generation_batch_size = {args.generation_batch_size} is not per_device_train_batch_size "
                         f"{args.per_device_train_batch_size} x data-parallel size {dp_size} x steps_per_generation "
                         f"{args.steps_per_generation}: the GRPOConfig counted the {args.world_size} ranks, which "
                         f"tsp.size {tsp_size} makes {dp_size} data-parallel replica(s). Import ds_tsp before "
                         "building the GRPOConfig (it has TRL's config count replicas) and set generation_batch_size "
                         "or steps_per_generation, not both, as under data parallelism")


def _refuse_a_second_adapter(trainer):
    """TRL keeps a frozen copy of a ``PeftModel``'s adapter, ``ref``, beside it
    as the reference when no ``peft_config`` (and, for DPO, no ``ref_model``)
    comes with it; a TSP model shards one adapter."""
    model = trainer.model
    adapters = sorted(getattr(model, "peft_config", {})) if is_peft_model(model) else []
    if trainer.tsp_topology is not None and len(adapters) > 1:
        raise ValueError(f"the PeftModel holds adapters {adapters} (TRL adds 'ref', a frozen copy of yours, as the "
                         "reference model of a PeftModel given without peft_config or ref_model): a TSP model "
                         "shards one adapter. Pass the base model with peft_config=LoraConfig(...), or with DPO "
                         "ref_model=copy.deepcopy(peft_model).merge_and_unload()")


def _objects_of_each_replica(topology):
    """``accelerate.utils.gather_object`` keeping one copy of each TSP group's objects."""

    def gather(objects):
        per_rank = gather_object([objects])
        return [item for rank, part in enumerate(per_rank) if rank % topology.tsp_size == 0 for item in part]

    return gather


def _tsp_section(args):
    """The ``tsp`` section of the arguments' DeepSpeed config (``TrainingArguments(deepspeed=...)``'s or
    ``accelerate launch``'s); disabled without one."""
    plugin = getattr(args, "deepspeed_plugin", None)
    return split_ds_config(plugin.deepspeed_config if plugin is not None else {})[1]
