"""Pipeline stages of TSP blocks: an injected causal LM as a DeepSpeed ``PipelineModule``.

The layers are: embedding (takes the full micro-batch, keeps this rank's
tokens), one pipe layer per TSP decoder layer, final norm; the loss function
applies the LM head (on the last stage, where it lives) and returns the mean
over all real tokens of the full sequence, fused on the ring when the
vocabulary is folded. What passes between stages is
``(hidden (B, S/D, H), positions (B, S/D + 1))``: the local shard, never the
full sequence (``positions`` are this rank's position ids and, last, the
sequence's largest, which rotary types that scale with the sequence read).
Mixture-of-experts models with ``output_router_logits`` add a third tensor,
the load-balancing statistics of the layers so far (``(2E+1,)`` float64,
``ds_tsp.blocks.moe.load_balancing.routing_statistics``, this rank's tokens): each MoE layer adds
its own, and the loss adds ``router_aux_loss_coef`` times the loss they give
over the whole sequence, as the unstaged model does. Their gradient comes
back with the hidden state's and enters each layer's router through
``_StatisticsLink`` in the same backward pass (DeepSpeed runs one backward
call per floating output; without the link the statistics' call would run the
layers' backward a second time, and DeepSpeed's reentrant checkpoint cannot
run twice, so these models checkpoint with ``pipeline.use_reentrant: false``).
The pipeline topology is
DeepSpeed's ``pipe x data x model`` with the TSP group as the model axis, the
same rank order as ``ds_tsp.parallel.topology``.
"""

import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ds_tsp.blocks.moe.load_balancing import balance_loss, recorded_router_logits, routing_statistics
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.rotary import rotary_tables
from ds_tsp.blocks.vocab import LogitMap, embed_local_tokens, embedding_multiplier
from ds_tsp.injection.inputs import check_token_ids, vocabulary_rows
from ds_tsp.injection.model import TSPBatch, lm_head_and_loss, normalize
from ds_tsp.injection.policy import load_balancing_loss
from ds_tsp.parallel.eager import EagerFunction


class TSPEmbeddingPipe(nn.Module):
    def __init__(self, embed_tokens, topology, layout_name, batch_check, num_experts=0, multiplier=1.0):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.multiplier = multiplier  # the model's embedding_multiplier (Granite's)
        self.tsp_rank, self.tsp_size, self.layout_name = topology.tsp_rank, topology.tsp_size, layout_name
        self.batch_check = batch_check  # tsp.check_batch: the same micro-batch on every TSP rank
        self.num_experts = num_experts  # > 0: the message carries load-balancing statistics

    def forward(self, input_ids):
        batch = TSPBatch(input_ids, None, None, None, self.tsp_rank, self.tsp_size, self.layout_name,
                         vocab_size=(vocabulary_rows(self.embed_tokens),), batch_check=self.batch_check)
        positions = torch.cat([batch.position_ids, batch.max_position.expand(input_ids.shape[0], 1)], dim=1)
        hidden = embed_local_tokens(self.embed_tokens, batch.rank_input_ids, self.tsp_rank, batch.input_ids,
                                    self.multiplier)
        if not self.num_experts:
            return hidden, positions
        # A leaf that takes a gradient, so a first stage without MoE layers still has one for each float output.
        statistics = torch.zeros(2 * self.num_experts + 1, dtype=torch.float64, device=hidden.device,
                                 requires_grad=True)
        return hidden, positions, statistics


class TSPDecoderLayerPipe(nn.Module):
    """One TSP decoder layer; rotary embeddings are recomputed from the positions
    (cheap, and it keeps the inter-stage message to the hidden shard)."""

    def __init__(self, layer, rotary_emb):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.moe_blocks = [module for module in layer.modules() if isinstance(module, TSPSparseMoE)]

    def forward(self, inputs):
        hidden, positions, *statistics = inputs
        tables = rotary_tables(self.rotary_emb, hidden, positions[:, :-1], positions[:, -1:], self.layer.rotary_kind)
        blocks = self.moe_blocks if statistics else []
        with recorded_router_logits(blocks) as router_logits:
            # The pipeline takes input ids alone: position ids are each token's index, as is its cache position.
            hidden = self.layer(hidden, tables, positions=positions[:, :-1], cache_positions=positions[:, :-1])
        if not statistics:
            return hidden, positions
        statistics = statistics[0]
        if blocks:
            # Without a mask, the padding TSP appends is what lies past the sequence's largest position.
            real = positions[:, :-1] <= positions[:, -1:]
            mine = sum(routing_statistics(logits, real, block.top_k)
                       for logits, block in zip(router_logits, blocks))
            hidden, link = _StatisticsLink.apply(hidden, mine)
            statistics = statistics + mine.detach() + link
        return hidden, positions, statistics


class _StatisticsLink(EagerFunction):
    """``(hidden, zeros)``: the layer's output unchanged, and a zero tensor the
    layer adds to the statistics it passes on. In backward the statistics'
    gradient arrives through the zeros; it is held until the hidden state's
    gradient arrives too (in the same backward call, or in DeepSpeed's next
    one) and both go on together, the statistics' into this layer's routers.
    So the statistics' own backward call stops here, and the layer's backward
    runs once."""

    @staticmethod
    def forward(ctx, hidden, statistics):
        ctx.set_materialize_grads(False)
        ctx.arrived = {}
        return hidden.view_as(hidden), torch.zeros_like(statistics)

    @staticmethod
    def backward(ctx, grad_hidden, grad_statistics):
        for key, grad in (("hidden", grad_hidden), ("statistics", grad_statistics)):
            if grad is not None:
                ctx.arrived[key] = grad + ctx.arrived[key] if key in ctx.arrived else grad
        if len(ctx.arrived) < 2:
            return None, None
        arrived, ctx.arrived = ctx.arrived, {}
        return arrived["hidden"], arrived["statistics"]


class TSPHeadPipe(nn.Module):
    """The final norm; holds the LM head, which ``TSPPipeLoss`` applies."""

    def __init__(self, norm, lm_head, recompute_norm=False):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.recompute_norm = recompute_norm  # tsp.recompute_norms

    def forward(self, inputs):
        hidden, _, *statistics = inputs
        hidden = normalize(self.norm, hidden, self.recompute_norm)
        return (hidden, *statistics) if statistics else hidden


class TSPPipeLoss:
    """LM head and mean cross-entropy over all real tokens of the full sequence
    (labels come full, as the data iterator yields them), plus
    ``aux_loss_coef`` times the load-balancing loss when the last stage's
    output carries its statistics; the logits mapped by ``logit_map`` (``LogitMap``)."""

    def __init__(self, head_pipe, topology, layout_name, aux_loss_coef=0.0, logit_map=None):
        self.head_pipe, self.topology, self.layout_name = head_pipe, topology, layout_name
        self.aux_loss_coef, self.logit_map = aux_loss_coef, logit_map

    def __call__(self, outputs, labels):
        topo = self.topology
        hidden, *statistics = outputs if isinstance(outputs, tuple) else (outputs,)
        check_token_ids(None, labels, vocabulary_rows(self.head_pipe.lm_head))
        batch = TSPBatch(labels, labels, None, None, topo.tsp_rank, topo.tsp_size, self.layout_name)
        loss, _ = lm_head_and_loss(self.head_pipe.lm_head, hidden, batch, topo.tsp_group,
                                   logit_map=self.logit_map)
        if statistics:
            loss = loss + self.aux_loss_coef * balance_loss(statistics[0], topo.tsp_group)
        return loss


def carries_routing_statistics(config, model_class=None):
    """Whether the stages pass load-balancing statistics: a mixture-of-experts
    model with ``output_router_logits`` whose Hugging Face forward adds
    Mixtral's load-balancing loss (``policy.load_balancing_loss`` of
    ``model_class``, by default the causal LM transformers maps ``config`` to;
    GLM-4.5's adds none)."""
    experts = max((getattr(config, key, 0) or 0) for key in ("num_local_experts", "num_experts", "n_routed_experts"))
    if experts <= 1 or not getattr(config, "output_router_logits", False):
        return False
    model_class = model_class or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return model_class is None or load_balancing_loss(model_class) == "switch"


def check_pipeline_stages(config, tsp_config, ds_config=None, model_class=None):
    """Refuse, from the configs alone, a model the pipeline stages cannot split;
    set what DeepSpeed's pipeline engine must do for it in ``ds_config``."""
    if config.get_text_config() is not config:
        raise ValueError(f"tsp.pipeline_stages = {tsp_config.pipeline_stages} with a vision-language model "
                         f"({type(config).__name__}): pipeline stages of a VLM (its tower and visual rows) are not "
                         "built; train it with tsp.pipeline_stages 1 (TSP x DP)")
    layers, stages = config.num_hidden_layers, tsp_config.pipeline_stages
    shared = getattr(config, "num_kv_shared_layers", 0) or getattr(config, "hidden_size_per_layer_input", 0)
    if shared:
        raise ValueError(f"tsp.pipeline_stages = {stages} with a model whose layers take more than the hidden "
                         f"state from the layers before them (num_kv_shared_layers = "
                         f"{getattr(config, 'num_kv_shared_layers', 0)}: keys and values shared across layers; "
                         f"hidden_size_per_layer_input = {getattr(config, 'hidden_size_per_layer_input', 0)}: "
                         "per-layer inputs from the embedding), which the pipeline's stages do not pass on: train "
                         "it with tsp.pipeline_stages 1 (TSP x DP)")
    if layers % stages:
        raise ValueError(f"num_hidden_layers = {layers} does not split evenly over tsp.pipeline_stages = "
                         f"{stages}: choose tsp.pipeline_stages from the divisors of {layers}")
    if ds_config is not None and carries_routing_statistics(config, model_class) and \
            ds_config.get("activation_checkpointing"):
        pipeline = ds_config.setdefault("pipeline", {})
        if pipeline.get("use_reentrant"):
            raise ValueError("pipeline.use_reentrant = true: the stages of this mixture-of-experts model pass their "
                             "load-balancing statistics beside the hidden state, and DeepSpeed's reentrant "
                             "checkpoint cannot run backward for two outputs: set pipeline.use_reentrant to false "
                             "or leave it out, or set output_router_logits = false in the model config")
        pipeline["use_reentrant"] = False
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings = true ties the first and last pipeline stages, which ds_tsp does not "
                         "support yet: use tsp.pipeline_stages = 1 for this model")


def build_pipeline(model, topology, tsp_config, activation_checkpointing=False):
    """A ``PipelineModule`` over an injected model (see ``ds_tsp.inject``).

    Decoder layers are split evenly over ``tsp.pipeline_stages``; the embedding
    goes with the first stage and the head with the last.
    """
    check_pipeline_stages(model.config, tsp_config, model_class=type(model))
    policy, stages = model.tsp_policy, tsp_config.pipeline_stages
    decoder_layers = list(model.get_submodule(policy.layers))
    rotary_emb = policy.rotary_module(model)
    moe_blocks = [module for module in model.modules() if isinstance(module, TSPSparseMoE)]
    num_experts = moe_blocks[0].num_experts if moe_blocks and carries_routing_statistics(model.config, type(model)) \
        else 0
    layers = [TSPEmbeddingPipe(model.get_submodule(policy.embed_tokens), topology, tsp_config.layout,
                               model.tsp_batch_check, num_experts, embedding_multiplier(model.config))]
    layers += [TSPDecoderLayerPipe(layer, rotary_emb) for layer in decoder_layers]
    head = TSPHeadPipe(model.get_submodule(policy.final_norm), model.get_submodule(policy.lm_head),
                       tsp_config.recompute_norms)
    layers.append(head)
    pipe_topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=topology.tsp_size, num_dp=topology.dp_size)
    loss_fn = TSPPipeLoss(head, topology, tsp_config.layout, getattr(model.config, "router_aux_loss_coef", 0.0),
                          LogitMap.of(model.config))
    pipe = PipelineModule(layers=layers, loss_fn=loss_fn, topology=pipe_topology,
                          partition_method="type:TSPDecoderLayerPipe",
                          activation_checkpoint_interval=1 if activation_checkpointing else 0,
                          checkpointable_layers=["TSPDecoderLayerPipe"])
    # What ds_tsp.save_pretrained needs to write the stages as the model they came from.
    pipe.tsp_topology, pipe.tsp_config, pipe.tsp_policy = topology, tsp_config, policy
    pipe.tsp_model_class, pipe.tsp_model_config = type(model), model.config
    pipe.tsp_generation_config = getattr(model, "generation_config", None)
    return pipe


def hf_prefixes(policy, num_layers):
    """``{pipe module prefix: Hugging Face module prefix}`` of every layer
    ``build_pipeline`` makes, whatever the number of stages (DeepSpeed names
    the layers by their index in the whole pipeline)."""
    names = {"0.embed_tokens": policy.embed_tokens}
    names.update({f"{index + 1}.layer": f"{policy.layers}.{index}" for index in range(num_layers)})
    names.update({f"{num_layers + 1}.norm": policy.final_norm, f"{num_layers + 1}.lm_head": policy.lm_head})
    return names


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
