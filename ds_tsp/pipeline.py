"""Pipeline stages of TSP blocks: an injected causal LM as a DeepSpeed ``PipelineModule``.

The layers are: embedding (takes the full micro-batch, keeps this rank's
tokens), one pipe layer per TSP decoder layer, final norm; the loss function
applies the LM head (on the last stage, where it lives) and returns the mean
over all real tokens of the full sequence, fused on the ring when the
vocabulary is folded. What passes between stages is
``(hidden (B, S/D, H), positions (B, S/D + 1))``: the local shard, never the
full sequence (``positions`` are this rank's position ids and, last, the
sequence's largest, which rotary types that scale with the sequence read). The pipeline topology is DeepSpeed's ``pipe x data x model``
with the TSP group as the model axis, the same rank order as
``ds_tsp.topology``.
"""

import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from .model import TSPBatch, lm_head_and_loss, rotary_tables
from .vocab import embed_local_tokens


class TSPEmbeddingPipe(nn.Module):
    def __init__(self, embed_tokens, topology, layout_name, batch_check):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.tsp_rank, self.tsp_size, self.layout_name = topology.tsp_rank, topology.tsp_size, layout_name
        self.batch_check = batch_check  # tsp.check_batch: the same micro-batch on every TSP rank

    def forward(self, input_ids):
        self.batch_check(input_ids=input_ids)
        batch = TSPBatch(input_ids, None, None, None, self.tsp_rank, self.tsp_size, self.layout_name)
        positions = torch.cat([batch.position_ids, batch.max_position.expand(input_ids.shape[0], 1)], dim=1)
        return embed_local_tokens(self.embed_tokens, batch.rank_input_ids, self.tsp_rank, batch.input_ids), positions


class TSPDecoderLayerPipe(nn.Module):
    """One TSP decoder layer; rotary embeddings are recomputed from the positions
    (cheap, and it keeps the inter-stage message to the hidden shard)."""

    def __init__(self, layer, rotary_emb):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb

    def forward(self, inputs):
        hidden, positions = inputs
        tables = rotary_tables(self.rotary_emb, hidden, positions[:, :-1], positions[:, -1:])
        return self.layer(hidden, tables), positions


class TSPHeadPipe(nn.Module):
    """The final norm; holds the LM head, which ``TSPPipeLoss`` applies."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, inputs):
        hidden, _ = inputs
        return self.norm(hidden)


class TSPPipeLoss:
    """LM head and mean cross-entropy over all real tokens of the full sequence
    (labels come full, as the data iterator yields them)."""

    def __init__(self, head_pipe, topology, layout_name):
        self.head_pipe, self.topology, self.layout_name = head_pipe, topology, layout_name

    def __call__(self, hidden, labels):
        topo = self.topology
        batch = TSPBatch(labels, labels, None, None, topo.tsp_rank, topo.tsp_size, self.layout_name)
        loss, _ = lm_head_and_loss(self.head_pipe.lm_head, hidden, batch, topo.tsp_group)
        return loss


def check_pipeline_stages(config, tsp_config):
    """Refuse, from the config alone, a model the pipeline stages cannot split."""
    layers, stages = config.num_hidden_layers, tsp_config.pipeline_stages
    if layers % stages:
        raise ValueError(f"num_hidden_layers = {layers} does not split evenly over tsp.pipeline_stages = "
                         f"{stages}: choose tsp.pipeline_stages from the divisors of {layers}")
    experts = next((key for key in ("num_local_experts", "num_experts") if (getattr(config, key, 0) or 0) > 1), None)
    if experts:
        raise ValueError(f"{experts} = {getattr(config, experts)}: mixture-of-experts models are not supported with "
                         "tsp.pipeline_stages > 1 yet (the stages would drop the load-balancing loss): use "
                         "tsp.pipeline_stages = 1")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings = true ties the first and last pipeline stages, which ds_tsp does not "
                         "support yet: use tsp.pipeline_stages = 1 for this model")


def build_pipeline(model, topology, tsp_config, activation_checkpointing=False):
    """A ``PipelineModule`` over an injected model (see ``ds_tsp.inject``).

    Decoder layers are split evenly over ``tsp.pipeline_stages``; the embedding
    goes with the first stage and the head with the last.
    """
    check_pipeline_stages(model.config, tsp_config)
    policy, stages = model.tsp_policy, tsp_config.pipeline_stages
    decoder_layers = list(model.get_submodule(policy.layers))
    rotary_emb = model.get_submodule(policy.rotary_emb)
    layers = [TSPEmbeddingPipe(model.get_submodule(policy.embed_tokens), topology, tsp_config.layout,
                               model.tsp_batch_check)]
    layers += [TSPDecoderLayerPipe(layer, rotary_emb) for layer in decoder_layers]
    head = TSPHeadPipe(model.get_submodule(policy.final_norm), model.get_submodule(policy.lm_head))
    layers.append(head)
    pipe_topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=topology.tsp_size, num_dp=topology.dp_size)
    pipe = PipelineModule(layers=layers, loss_fn=TSPPipeLoss(head, topology, tsp_config.layout), topology=pipe_topology,
                          partition_method="type:TSPDecoderLayerPipe",
                          activation_checkpoint_interval=1 if activation_checkpointing else 0,
                          checkpointable_layers=["TSPDecoderLayerPipe"])
    # What ds_tsp.save_pretrained needs to write the stages as the model they came from.
    pipe.tsp_topology, pipe.tsp_config, pipe.tsp_policy = topology, tsp_config, policy
    pipe.tsp_model_class, pipe.tsp_model_config = type(model), model.config
    pipe.tsp_generation_config = getattr(model, "generation_config", None)
    return pipe


def stage_modules(pipe):
    """``{Hugging Face module name: module}`` of the layers this rank's stage of
    a ``build_pipeline`` pipeline holds (DeepSpeed names them by layer index)."""
    policy, modules = pipe.tsp_policy, {}
    for index, layer in pipe.named_children():
        if isinstance(layer, TSPEmbeddingPipe):
            modules[policy.embed_tokens] = layer.embed_tokens
        elif isinstance(layer, TSPDecoderLayerPipe):
            modules[f"{policy.layers}.{int(index) - 1}"] = layer.layer
        elif isinstance(layer, TSPHeadPipe):
            modules.update({policy.final_norm: layer.norm, policy.lm_head: layer.lm_head})
    return modules
