"""The Hugging Face Trainer with TSP: ``TSPTrainer``, a drop-in ``transformers.Trainer``.

The DeepSpeed config of ``TrainingArguments(deepspeed=...)``, or the
``deepspeed_config_file`` of the DeepSpeed plugin that ``accelerate launch
--config_file`` names, carries the ``tsp`` section; nothing else changes for
the user. The Trainer keeps its own
loop, optimizer, scheduler, logging, evaluation and checkpoints. TSP enters
through the contracts transformers and accelerate already have, in this order:

1. the accelerator's DeepSpeed device mesh (``state.ds_device_mesh``, which
   accelerate's AutoTP fills): a ``("dp", "tp")`` mesh with the TSP group as
   ``tp``, so accelerate's data-loader preparation shards the sampler over the
   data-parallel replicas and hands every rank of a TSP group the same batch;
2. the Trainer's count of ranks that share a batch (``get_tp_size``), from
   which it derives the total batch size, steps, epochs and learning-rate
   schedule, the ``num_items_in_batch`` of a gradient-accumulation window
   (gathered over the world, divided by it) and the loss scale
   ``num_processes // tp_size`` (the data-parallel size);
3. the engine accelerate builds: its call to ``deepspeed.initialize`` runs
   ``ds_tsp.initialize`` instead (injection, the TSP ``mpu``, the Trainer's
   AdamW rebuilt over the shards with its weight-decay groups by name);
4. evaluation gathers one copy per TSP group, the token count divides by the
   TSP size, and ``save_model`` writes gathered Hugging Face files;
5. ``resume_from_checkpoint`` from a checkpoint saved at another TSP x DP
   layout or ZeRO stage reshards its DeepSpeed files into ``universal/`` beside
   them (``ds_tsp.checkpoint.resharding``) and loads that.

Pipelines (``tsp.pipeline_stages > 1``) are refused: the Trainer drives a
forward and backward per micro-batch, a pipeline engine a whole batch.
"""

import contextlib
import functools
import os
import shutil

import deepspeed
import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from torch.distributed.device_mesh import DeviceMesh
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ds_tsp.checkpoint import save_pretrained
from ds_tsp.checkpoint.staging import SaveError, SharedSave
from ds_tsp.config import split_ds_config
from ds_tsp.injection.lora import is_peft_model
from ds_tsp.injection.model import TSPCausalLMMixin
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.runtime.engine import initialize
from ds_tsp.runtime.trl_seams import trl_seams_replaced

logger = logging.get_logger(__name__)


class TSPTrainerMixin:
    """Put in front of ``transformers.Trainer`` or one of its subclasses:
    ``class TSPSFTTrainer(TSPTrainerMixin, trl.SFTTrainer): pass``
    (``ds_tsp.runtime.trl_trainers`` has TRL's). Without a ``tsp`` section (or
    with ``tsp.enabled: false``) the class is the Trainer it mixes into. The
    trainer's own loss runs on the TSP forward: TRL's through its fused LM
    head (``ds_tsp.runtime.trl_seams``); a loss that would need the logits of
    every token (``label_smoothing_factor``, ``compute_loss_func``) is refused."""

    tsp_topology = None
    tsp_config = None

    def __init__(self, *args, **kwargs):
        with trl_seams_replaced(self):
            super().__init__(*args, **kwargs)
        if self.tsp_topology is None:
            return
        if self.label_smoother is not None or self.compute_loss_func is not None:
            option = "label_smoothing_factor" if self.label_smoother is not None else "compute_loss_func"
            raise ValueError(f"{option}: the loss would be computed from the model's logits, which a TSP forward "
                             "gives for this rank's tokens only; leave it unset under TSP (the TSP forward computes "
                             "the loss over the whole sequence)")

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if not self.is_deepspeed_enabled:
            return
        _, tsp_config = split_ds_config(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        if not tsp_config.enabled:
            return
        if tsp_config.pipeline_stages > 1:
            raise ValueError(f"tsp.pipeline_stages = {tsp_config.pipeline_stages} is not supported by the Trainer, "
                             "which runs a forward and backward per micro-batch while a pipeline engine runs whole "
                             "batches (train_batch): use ds_tsp.initialize in your own loop, or pipeline_stages 1")
        launched = int(os.environ.get("WORLD_SIZE", 1))
        if self.accelerator.state.num_processes != launched:
            raise RuntimeError(f"accelerate's state counts {self.accelerator.state.num_processes} process(es) but "
                               f"the launcher started {launched}: accelerate sets DeepSpeed up over the ranks only on "
                               "an accelerator it knows; on CPU ranks call ds_tsp.configure_cpu_ranks() before "
                               "TrainingArguments(..., accelerator_config={'use_configured_state': True})")
        tsp_config.check_world(dist.get_world_size())
        self.tsp_topology, self.tsp_config = TSPTopology.of(tsp_config), tsp_config
        accelerator = self.accelerator
        accelerator.__class__ = _tsp_accelerator_class(type(accelerator))
        accelerator.tsp_topology = self.tsp_topology
        accelerator.state.ds_device_mesh = shared_batch_mesh(self.tsp_topology, accelerator.device.type)
        # Bound before the class changed: bind the TSP gather.
        self.gather_function = functools.partial(accelerator.gather_for_metrics,
                                                 use_gather_object=self.args.eval_use_gather_object)

    def get_tp_size(self):
        """Ranks that share a batch: the Trainer divides the world by it for the
        data-parallel size and the token count of ``num_items_in_batch``."""
        if self.tsp_topology is None:
            return super().get_tp_size()
        return self.tsp_topology.tsp_size

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """``(loss, predictions, labels)`` of one evaluation micro-batch, as the
        Trainer's: the TSP forward gives every rank the whole sequence's
        predictions. With ``preprocess_logits_for_metrics=ds_tsp.argmax_token_ids``
        they are the predicted ids ``(B, S)``, found on the folded head's ring
        without full logits; otherwise the full logits ``(B, S, V)``, gathered,
        which the Trainer hands to the user's ``preprocess_logits_for_metrics``."""
        if self.tsp_topology is None or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        labels = None
        if self.label_names and all(inputs.get(name) is not None for name in self.label_names):
            labels = tuple(inputs[name].detach() for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        kind = "argmax" if self.preprocess_logits_for_metrics is argmax_token_ids else "logits"
        with torch.no_grad():
            outputs = model(**inputs, tsp_predictions=kind)
        return (None if outputs.loss is None else outputs.loss.detach()), outputs.logits, labels

    def _track_num_input_tokens(self, inputs):
        # The Trainer sums every rank's tokens; the ranks of a TSP group hold the same ones.
        seen = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self.tsp_topology is not None:
            added = self.state.num_input_tokens_seen - seen
            self.state.num_input_tokens_seen = seen + added // self.tsp_topology.tsp_size

    def save_model(self, output_dir=None, _internal_call=False):
        """The Trainer's ``save_model`` on a TSP engine, at every ZeRO stage:
        ``ds_tsp.save_pretrained`` gathers each block from its TSP and (ZeRO-3)
        data-parallel shards, where the Trainer's own path would gather the
        whole model's TSP shards at once (``accelerator.get_state_dict``).
        ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save: false`` saves the
        DeepSpeed checkpoint only, as Hugging Face does, and says how to export it."""
        if self.tsp_topology is None or _tsp_model(self.model) is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.model_wrapped
        if engine.zero_optimization_partition_weights() and not engine.zero_gather_16bit_weights_on_model_save():
            logger.warning(f"stage3_gather_16bit_weights_on_model_save=false: saving the DeepSpeed checkpoint only; "
                           f"turn it into a Hugging Face directory with `ds-tsp export --checkpoint {output_dir} "
                           "--model <the model's Hugging Face directory> --out <dir> --fp32-master`")
            self._save_trainer_files(output_dir)
            engine.save_checkpoint(output_dir)
        else:
            self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir=None, state_dict=None):
        """Gathered Hugging Face files (``ds_tsp.save_pretrained``), which every
        rank joins; the Trainer's own files (processing class, arguments) as usual."""
        if self.tsp_topology is None or _tsp_model(self.model) is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(_tsp_model(self.model), output_dir, overwrite=True)
        self._save_trainer_files(output_dir)

    def _save_trainer_files(self, output_dir):
        """What the Trainer writes beside the weights (processing class,
        arguments), from the saving rank. Collective: a failed write raises on
        every rank (``staging.SharedSave``)."""
        save = SharedSave(f"the Trainer's files in {output_dir}")
        if self.args.should_save:
            save.write(output_dir, self._write_trainer_files, output_dir)
        save.agree()

    def _write_trainer_files(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, f"{output_dir}/{TRAINING_ARGS_NAME}")

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint, on every rank or none: an error writing
        any of it (the weights, DeepSpeed's tag, the RNG states, the trainer
        state) raises the same ``SaveError`` on every rank, and a
        ``checkpoint-N`` folder this save made is removed, so that a resume
        finds the one before. The weights and the tag agree on their own; the
        Trainer's other files are written by one rank or each, after them."""
        if self.tsp_topology is None:
            return super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        made_here = not os.path.exists(folder)
        save = SharedSave(f"the Trainer's checkpoint {folder}")
        save.write(folder, super()._save_checkpoint, model, trial)
        try:
            save.agree(f"{folder} was removed" if made_here else "")
        except SaveError:
            if made_here and self.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            raise


def argmax_token_ids(logits, labels=None):
    """The predicted token ids ``logits.argmax(-1)``: pass it as the Trainer's
    ``preprocess_logits_for_metrics`` (to ``transformers.Trainer`` too, where
    it is just that). ``TSPTrainer`` finds the ids on the folded LM head's ring
    and hands them here, where integer ids pass through unchanged."""
    return logits if not logits.is_floating_point() else logits.argmax(dim=-1)


def _tsp_model(model):
    """The TSP model that the Trainer's ``model`` is, or wraps (a ``PeftModel``'s
    Hugging Face model, which the engine holds); None before injection."""
    inner = model.base_model.model if is_peft_model(model) else model
    return inner if isinstance(inner, TSPCausalLMMixin) else None


class TSPTrainer(TSPTrainerMixin, Trainer):
    """``transformers.Trainer`` with TSP from the DeepSpeed config's ``tsp`` section."""


def configure_cpu_ranks():
    """Let the Trainer run DeepSpeed on CPU ranks (tests, CPU demos): accelerate
    sets DeepSpeed up only on an accelerator it knows, so this configures its
    state for DeepSpeed over gloo first; pass ``TrainingArguments(...,
    accelerator_config={"use_configured_state": True})`` to use it. Call it before
    each Trainer (a second one needs accelerate's state afresh). Not needed on GPUs."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    # `accelerate launch` with a DeepSpeed plugin sets this for the whole run (TrainingArguments reads it to
    # build the plugin from the accelerate config): it is restored as found.
    launched_with = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        if launched_with is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = launched_with


def shared_batch_mesh(topology, device_type):
    """The ``("dp", "tp")`` device mesh over the topology's own groups: accelerate
    gives the ranks of one ``tp`` row the same batches (TSP is innermost, so
    ``rank // tsp_size`` is the data-parallel rank)."""
    world = topology.dp_size * topology.tsp_size
    return DeviceMesh.from_group([topology.dp_group, topology.tsp_group], device_type,
                                 mesh=torch.arange(world).view(topology.dp_size, topology.tsp_size),
                                 mesh_dim_names=("dp", "tp"))


class TSPAcceleratorMixin:
    """Put in front of the Trainer's ``Accelerator`` class by ``TSPTrainerMixin``."""

    tsp_topology = None
    _one_copy_per_tsp_group = False
    _data_parallel_view = False

    @property
    def num_processes(self):
        return self.tsp_topology.dp_size if self._data_parallel_view else super().num_processes

    @property
    def process_index(self):
        return self.tsp_topology.dp_rank if self._data_parallel_view else super().process_index

    @contextlib.contextmanager
    def data_parallel_view(self):
        """While the body runs, ``num_processes`` and ``process_index`` are the
        data-parallel size and rank, and ``gather`` keeps one copy of each TSP
        group's tensors: the accelerator as a trainer that slices and
        normalizes its batch by processes (TRL's GRPO) must see it."""
        self._data_parallel_view = self._one_copy_per_tsp_group = True
        try:
            yield
        finally:
            self._data_parallel_view = self._one_copy_per_tsp_group = False

    def _prepare_deepspeed(self, *args):
        with _deepspeed_initialize_replaced(functools.partial(_tsp_engine, self.tsp_topology)):
            return super()._prepare_deepspeed(*args)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Accelerate's, over the data-parallel replicas: its drop of the last
        batch's padding samples counts them (the data loader's ``num_processes``)."""
        if use_gather_object:
            raise NotImplementedError("eval_use_gather_object gathers Python objects from every rank, repeating "
                                      "each TSP group's: leave it False under TSP")
        self._one_copy_per_tsp_group = True
        try:
            return super().gather_for_metrics(input_data)
        finally:
            self._one_copy_per_tsp_group = False

    def gather(self, tensor):
        gathered = super().gather(tensor)
        if not self._one_copy_per_tsp_group:
            return gathered
        topology = self.tsp_topology

        def first_of_each_group(t):  # (world * n, ...) in rank order -> (dp * n, ...)
            return t.unflatten(0, (topology.dp_size, topology.tsp_size, -1))[:, 0].flatten(0, 1)

        return recursively_apply(first_of_each_group, gathered)


_TSP_ACCELERATORS = {}


def _tsp_accelerator_class(cls):
    if cls not in _TSP_ACCELERATORS:
        _TSP_ACCELERATORS[cls] = type(f"TSP{cls.__name__}", (TSPAcceleratorMixin, cls), {})
    return _TSP_ACCELERATORS[cls]


@contextlib.contextmanager
def _deepspeed_initialize_replaced(build):
    """Accelerate calls ``deepspeed.initialize`` from inside ``_prepare_deepspeed``
    after filling the config; for that one call, ``build`` runs instead, and
    sees DeepSpeed's own ``initialize`` again."""
    original = deepspeed.initialize

    def initialize_once(**kwargs):
        deepspeed.initialize = original
        return build(**kwargs)

    deepspeed.initialize = initialize_once
    try:
        yield
    finally:
        deepspeed.initialize = original


def _tsp_engine(topology, config_params, model, **kwargs):
    """``ds_tsp.initialize`` with accelerate's arguments. Accelerate counts every
    rank as a data-parallel replica in ``train_batch_size``; DeepSpeed checks it
    against the TSP mpu's data-parallel size."""
    config = dict(config_params)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                  * topology.dp_size)
    engine, *rest = initialize(model=model, config=config, tsp_topology=topology, **kwargs)
    # resume_from_checkpoint at another layout reshards the checkpoint's DeepSpeed files on the way.
    engine.tsp_reshard_on_load = True
    return (engine, *rest)
