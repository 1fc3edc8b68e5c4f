"""TSP's plan: one rank's memory, communication and FLOPs when ds_tsp's blocks
fold a model over ``D`` devices (DESIGN.md 8).

TSP is planned twice: ``TSP(N)`` folds the vocabulary as ``tsp.vocab_parallel``
(the default) does, ``ceil(V/N)`` rows of the embedding and the LM head per
device; ``TSP(N) replicated vocab`` keeps both whole on every device. A sparse
layer holds ``E/D`` experts per rank, which travel round the ring as the MLP's
shards do or stay at rest while the tokens go to them by all-to-all
(``tsp.moe_schedule``, ``ds_tsp.blocks.moe.module``); a hybrid's Gated DeltaNet
layer holds its head group, ``1/D`` of the layer, and gathers state maps where
an attention gathers K/V (``ds_tsp.blocks.linear.schedule``).

The TSP group may be ``D < N`` devices (``Setting.tsp_size``), ``N/D``
data-parallel replicas beside it, whose model states ZeRO-1/2 partition and
whose gradients DeepSpeed reduces. Their experts may fold across the replicas
(``Setting.expert_parallel_size``, DESIGN.md 6k): ``E/ep`` experts a rank over
``ep`` consecutive ranks, met by the token all-to-all over those ranks; their
gradients and ZeRO's partition of their states then span the
expert-data-parallel group, ``N/ep`` ranks, and the rest's the ``N/D`` replicas.

The peak is the largest of three phases of backward: one layer's (its MLP's,
then its token mixer's, once the MLP's saved tensors are freed), the head's
(final norm, LM head and loss, run before any gradient exists) and the folded
embedding's (run last). Communication is what ``communication`` counts, op by
op; FLOPs are ``flops.step_flops``' over ``D``.
"""

import dataclasses
from typing import NamedTuple

from ds_tsp.planning.communication import (
    tsp_layers_bytes_by_op,
    tsp_moe_schedule,
    tsp_step_bytes_by_op,
    tsp_vocab_bytes_by_op,
)
from ds_tsp.planning.flops import step_flops
from ds_tsp.planning.memory import (
    CHECKPOINT_BACK,
    CHECKPOINTS,
    EMBEDDING_BACKWARD,
    EVERY_LAYER,
    EXPERT_ROWS,
    GRAD_X,
    HEAD_BACKWARD,
    HOST_OPTIMIZER,
    HEAD_GROUP_LOCAL,
    HEAD_PHASE,
    KEPT_OUTSIDE,
    KV_GROUP,
    MLP_TILE,
    RECOMPUTED,
    RECURRENT_LOCAL,
    SHARDS,
    STATE_MAPS,
    STATES,
    checkpoints_on_device,
    host_memory,
    load_balancing_saved,
    logits_memory,
    lora_model_states,
    loss_backward_beyond,
    loss_backward_per_logit,
    model_level_saved,
    model_states,
    rms_norm_saved_per_call,
    rope_saved,
    transient_terms,
    tsp_block_saved_per_token,
    tsp_vocab_memory,
)
from ds_tsp.planning.plan_types import (
    EXPERT_GRAD_REDUCE,
    EXPERT_PARAM_GATHER,
    GRAD_REDUCE,
    PARAM_GATHER,
    TSP_EXPERT_ALL_TO_ALL,
    TSP_PARTS,
    VISION_GATHER,
    VISION_GRADS,
    VISION_ROWS,
    CommPart,
    StrategyPlan,
)
from ds_tsp.planning.shapes import (
    INT64,
    lora_adapter_params,
    padded_length,
    tsp_mixer_shard,
    tsp_name,
    tsp_shape_problem,
    vocab_rows_per_rank,
)
from ds_tsp.planning.visual import add_tower, tower_flops, tower_memory, tower_summary, tsp_visual_bytes_by_op


def plan_tsp(setting, vocab_parallel):
    """TSP: ds_tsp's blocks, with the vocabulary folded (``tsp.vocab_parallel``) or
    the embedding and LM head whole on every rank, over ``setting.tsp_group_size``
    ranks and its replicas. A sparse layer's experts are sharded ``E/ep`` per rank
    (``ep = D`` unless they fold across the replicas) and met by the schedule
    ``tsp_moe_schedule`` gives (``ds_tsp.blocks.moe.module``)."""
    m, D, dp, ep = setting.model, setting.tsp_group_size, setting.tsp_replicas, setting.expert_group_size
    problem = tsp_shape_problem(m, D)
    S = padded_length(setting.seq_len, D)  # two zigzag chunks per rank
    tokens = setting.micro_batch * S // D
    schedule = _moe_schedule(setting, S)
    memory, detail, terms, host = _tsp_memory(setting, vocab_parallel, tokens, schedule)
    forward, backward, per_step, parts = _tsp_communication(setting, vocab_parallel, S, problem)
    flops, attention_flops = _tsp_flops(setting, vocab_parallel, S, tokens, schedule)
    tower = {}
    if setting.vision and not problem:
        memory, terms, host, tower = _with_tower(setting, memory, terms, host)
        per_step += tower["comm_per_step"]
        parts = {**parts, **_tsp_tower_parts(setting)}
        flops, attention_flops = (total + tower_part for total, tower_part in
                                  zip((flops, attention_flops), tower_flops(setting, setting.patches / D)))
    refused = problem or _layout_problem(setting)
    notes = refused or ("" if S == setting.seq_len else f"sequence padded to {S}")
    layout = f"tsp={D}" + (f" x dp={dp}" if dp > 1 else "") + (f", ep={ep}" if ep > D else "") + \
        (f", moe_schedule={schedule}" if schedule and schedule != "ring" else "") + \
        f", vocab_parallel={str(vocab_parallel).lower()}"
    return StrategyPlan(tsp_name(D, vocab_parallel, dp, ep), layout, memory, forward, backward, per_step, flops,
                        tokens, setting, feasible=not refused, notes=notes, detail=detail, terms=terms, host=host,
                        comm_parts=parts, attention_flops_per_step=attention_flops, devices_per_replica=D,
                        attention_rows=S // D, tower=tower)


def _moe_schedule(setting, S):
    """The schedule the sparse layers run (None for a dense model): ``setting.moe_schedule``'s, the token
    all-to-all wherever the experts fold across replicas."""
    m, D = setting.model, setting.tsp_group_size
    if not m.is_moe:
        return None
    return tsp_moe_schedule(m, S, setting.micro_batch, D, setting.precision.element, setting.moe_schedule,
                            expert_parallel_size=setting.expert_group_size)


def _layout_problem(setting):
    """Why ds_tsp refuses the TSP rows' layout (``runtime.expert_parallel``, ``blocks.moe.module``), or the
    planner does not model it, or None."""
    stage = setting.zero_stage
    if setting.expert_group_size > setting.tsp_group_size:
        if stage in (0, 3):
            why = "DeepSpeed refuses ZeRO-3 with MoE layers" if stage else \
                "without ZeRO, DeepSpeed clips by the mean of the replicas' norms"
            return f"ds_tsp refuses expert_parallel_size > tsp.size with ZeRO-{stage} ({why}): use ZeRO-1 or 2"
    if stage >= 3 and setting.tsp_replicas > 1:
        return "ZeRO-3 over TSP's data-parallel replicas is not modelled: plan ZeRO-1 or 2"
    return None


def _token_tile(setting, tokens):
    """tsp.token_tile: the MLP runs the local tokens in tiles once they exceed one."""
    return min(tokens, setting.token_tile) if setting.token_tile else tokens


def _vocab_rows(setting, vocab_parallel):
    """Rows of the embedding (and of an untied LM head) one rank holds."""
    m = setting.model
    return vocab_rows_per_rank(m.vocab_size, setting.tsp_group_size) if vocab_parallel else m.vocab_size


def _ffn_shard(setting, sparse):
    """Elements of one layer's feed-forward block a rank holds: ``1/D`` of the MLP, or its ``E/ep`` routed
    experts and ``1/D`` of the shared expert."""
    m, D, ep = setting.model, setting.tsp_group_size, setting.expert_group_size
    if not sparse or ep == D:
        return m.ffn_params(sparse) / D
    return m.num_experts * m.expert_params / ep + m.shared_expert_params / D


def _held_experts(setting):
    """Elements of the routed experts one rank holds where they fold across replicas, every sparse layer's: the
    parameters reduced and partitioned over the expert-data-parallel group; 0 where they split over the TSP
    group alone, with everything else."""
    m, ep = setting.model, setting.expert_group_size
    return m.moe_layers * m.num_experts * m.expert_params / ep if ep > setting.tsp_group_size else 0


# --- memory --------------------------------------------------------------------------------------

class _OutsideLayers(NamedTuple):
    """What one rank keeps outside the layers, bytes."""

    saved: float  # saved for backward by the embedding, rotary, final norm and LM head's input
    logits_saved: float  # saved by the loss: labels and log-probabilities, or the folded loss's lse
    logits_held: float  # the logits output the model returns, kept through backward
    route: float  # the folded embedding's route, kept on ctx instead of its ids
    kept_outside: float  # what stays live through the layers' backward
    head_phase_bytes: float  # the head's phase: its saved tensors and the loss backward's buffers
    transient: dict  # the named pieces of the loss's (and folded embedding's) backward


def _tsp_memory(setting, vocab_parallel, tokens, schedule):
    """One rank's memory: ``(memory parts, detail, terms, host)``; ``schedule`` the sparse layers'."""
    m, D = setting.model, setting.tsp_group_size
    tile = _token_tile(setting, tokens)
    mixer_shard = {kind: tsp_mixer_shard(view, D, linear) for kind, (view, linear) in
                   ((kind, m.mixer_view(kind)) for kind, _ in m.mixer_kinds)}
    ffn_shard = {sparse: _ffn_shard(setting, sparse) for sparse, _ in m.layer_kinds}
    states, optimizer_host = _tsp_model_states(setting, vocab_parallel)
    saved = _tsp_blocks_saved(setting, tokens, tile < tokens, mixer_shard, ffn_shard, schedule == "all_to_all")
    every_layer = sum(layers * saved["attention"][kind] for kind, layers in m.mixer_kinds) + \
        sum(layers * saved["mlp"][sparse] for sparse, layers in m.layer_kinds)
    outside = _tsp_outside_layers(setting, vocab_parallel, tokens)
    mixer_pieces = {kind: _tsp_mixer_transient(_with_mixer(setting, kind), tokens, mixer_shard[kind],
                                               m.mixer_view(kind)[1])
                    for kind, _ in m.mixer_kinds}
    mlp_pieces = {sparse: _tsp_mlp_transient(setting, tokens, tile, ffn_shard[sparse], sparse, schedule)
                  for sparse, _ in m.layer_kinds}
    # One layer's backward at its peak (of the larger kinds where layers differ), the MLP's or the mixer's:
    # (its kinds, saved tensors still live, the backward's buffers by term).
    kinds, live, layer_pieces = max(
        (((kind, sparse), live, pieces) for kind, _ in m.mixer_kinds for sparse, _ in m.layer_kinds
         for live, pieces in _tsp_backward_phases(setting, saved["attention"][kind], saved["mlp"][sparse],
                                                  mixer_pieces[kind], mlp_pieces[sparse], every_layer)),
        key=lambda found: found[1] + sum(found[2].values()))
    detail = {
        "saved_for_backward": (outside.saved + every_layer + outside.logits_saved
                               if not setting.activation_checkpointing else None),
        "embedding_route": outside.route,
        "logits_output": outside.logits_held,
        **mixer_pieces[kinds[0]],
        **mlp_pieces[kinds[1]],
        **outside.transient,
    }
    checkpoints = checkpoints_on_device(setting, tokens, setting.prefetch_checkpoints)
    memory, terms = _tsp_peak(setting, vocab_parallel, states, outside, checkpoints, every_layer, live, layer_pieces)
    return memory, detail, terms, host_memory(setting, tokens, optimizer_host)


class _Held(NamedTuple):
    """The parameters one rank holds, elements (``_held_params``)."""

    params: float  # every one: its shards of every layer, the norms and routers whole, its embedding and LM head
    largest_layer: float  # one layer's, or the embedding's rows, the most: what an offloaded optimizer's device holds
    adapters: float = 0  # under LoRA, every layer's adapters: the parameters trained
    layer_adapters: float = 0  # and one layer's, the most


def _held_params(setting, vocab_parallel):
    """``_Held``: one rank's shards of every layer, the norms and routers whole, the embedding and LM head whole
    or folded; under LoRA also the adapters' shards."""
    m, D, H = setting.model, setting.tsp_group_size, setting.model.hidden_size
    mixer_params = {kind: tsp_mixer_shard(view, D, linear) + sum(view.mixer_replicated_tensors(linear))
                    for kind, (view, linear) in ((kind, m.mixer_view(kind)) for kind, _ in m.mixer_kinds)}
    ffn_params = {sparse: _ffn_shard(setting, sparse) + sum(m.ffn_replicated_tensors(sparse))
                  for sparse, _ in m.layer_kinds}
    vocab_rows = _vocab_rows(setting, vocab_parallel)
    vocab = vocab_rows * H * (1 if m.tie_word_embeddings else 2)
    params = sum(layers * mixer_params[kind] for kind, layers in m.mixer_kinds) + \
        sum(layers * ffn_params[sparse] for sparse, layers in m.layer_kinds) + H + vocab
    largest_layer = max(max(mixer_params.values()) + max(ffn_params.values()), vocab_rows * H)
    if not setting.lora_rank:
        return _Held(params, largest_layer)
    # Each kind of mixer layer's adapters (Gemma 4's full layers: their own heads), in proportion to the FFN kinds.
    adapters = {(kind, sparse): lora_adapter_params(m.mixer_view(kind)[0], setting.lora_rank, setting.lora_targets,
                                                    D, sparse)
                for kind, _ in m.mixer_kinds for sparse, _ in m.layer_kinds}
    total = sum(mixers * layers * adapters[kind, sparse] / m.num_layers
                for kind, mixers in m.mixer_kinds for sparse, layers in m.layer_kinds)
    return _Held(params, largest_layer, total, max(adapters.values()))


def _tsp_model_states(setting, vocab_parallel):
    """One rank's model states and its offloaded optimizer's host bytes (``_held_params``); under LoRA the
    frozen base and the adapters'. ZeRO partitions them over the data-parallel replicas, folded experts' over
    their expert-data-parallel group (DeepSpeed's MoE parameter groups)."""
    p, dp, held = setting.precision, setting.tsp_replicas, _held_params(setting, vocab_parallel)
    if setting.lora_rank:
        return lora_model_states(held.params, held.adapters, p, setting.zero_stage, dp, setting.offload_optimizer,
                                 layer_adapter_params=held.layer_adapters)
    experts = _held_experts(setting)
    states, host = model_states(held.params - experts, p, setting.zero_stage, dp, setting.offload_optimizer,
                                layer_params=held.largest_layer)
    if experts:
        expert_states, expert_host = model_states(experts, p, setting.zero_stage, setting.expert_replicas,
                                                  setting.offload_optimizer)
        states = {name: states[name] + expert_states[name] for name in states}
        host += expert_host
    return states, host


def _tsp_blocks_saved(setting, tokens, tiled, mixer_shard, ffn_shard, all_to_all=False):
    """``{"attention": {mixer kind: bytes}, "mlp": {sparse: bytes}}``: what one
    layer's token mixer and feed-forward block of each kind save for backward
    (``all_to_all``: the sparse layers under the token all-to-all)."""
    m, e, H = setting.model, setting.precision.element, setting.model.hidden_size

    def per_token(kind="attention", sparse=False):
        view, linear = m.mixer_view(kind)
        return tsp_block_saved_per_token(view, e, setting.tsp_attention_backward, tiled, sparse,
                                         setting.recompute_norms, linear, all_to_all)

    norm = rms_norm_saved_per_call(m, e, setting.recompute_norms)  # each block's norm's, once a layer
    saved = {"attention": {kind: tokens * per_token(kind)["attention"] + norm for kind, _ in m.mixer_kinds},
             "mlp": {sparse: tokens * per_token(sparse=sparse)["mlp"] + norm for sparse, _ in m.layer_kinds}}
    if setting.lora_rank:  # the merged shards W + sBA, kept from forward to backward
        for kind, shards in (("attention", mixer_shard), ("mlp", ffn_shard)):
            saved[kind] = {key: v + e * shards[key] for key, v in saved[kind].items()}
    if setting.activation_checkpointing:
        # DeepSpeed's checkpoint keeps the recomputed layer's output through the layer's backward (ds_tsp's
        # host checkpoint frees it); with tsp.recompute_norms the first norm keeps the layer's checkpointed
        # input, already counted as such.
        again = tokens * e * H * ((0 if setting.offload_activations else 1) - (1 if setting.recompute_norms else 0))
        saved["attention"] = {kind: v + again for kind, v in saved["attention"].items()}
    return saved


def _with_mixer(setting, kind):
    """``setting`` with its model as a kind of token mixer reads it (``ModelShape.mixer_view``)."""
    return dataclasses.replace(setting, model=setting.model.mixer_view(kind)[0])


def _tsp_outside_layers(setting, vocab_parallel, tokens):
    """``_OutsideLayers``: the embedding, rotary tables, final norm, LM head and loss."""
    m, p, B = setting.model, setting.precision, setting.micro_batch
    e = p.element
    # cos/sin of the local tokens plus, per sequence, the row of the largest position (rotary.rotary_tables)
    model_saved = model_level_saved(m, e, tokens, rope_rows=tokens + B, recompute_norm=setting.recompute_norms)
    model_saved += load_balancing_saved(m, tsp=True)
    if vocab_parallel:  # no logits tensor: the loss saves labels and the log-sum-exp
        logits_saved, vocab_transient = tsp_vocab_memory(m, p, setting.tsp_group_size, tokens,
                                                         setting.logits_tile_mib)
        logits_held = 0
        # A frozen head (LoRA) keeps no gradient accumulators on its ring.
        loss_backward = sum(vocab_transient[k] for k in HEAD_BACKWARD
                            if not (setting.lora_rank and k == "head_grad_accumulators"))
        # The embedding's backward keeps its route on ctx, not as saved tensors: the ids of its own rows that
        # every rank's tokens use (N expected) and the local tokens' order, instead of the ids nn.Embedding saves.
        model_saved -= tokens * INT64
        route = 2 * tokens * INT64
    else:
        logits_saved, logits_held = logits_memory(m, p, tokens, 1)
        vocab_transient = {"loss_backward": tokens * m.vocab_size * loss_backward_per_logit(p)}
        loss_backward = vocab_transient["loss_backward"]
        route = 0
    # Outside the layers only cos/sin and the embedding's ids (its route, folded) stay through the layers'
    # backward: the final norm's, the head's and the loss's saved tensors go with their own backward, which
    # runs first, so they count in the head's phase alone.
    kept_outside = rope_saved(m, e, tokens + B) + (route if vocab_parallel else tokens * INT64)
    head_saved = model_saved + route - kept_outside + logits_saved
    return _OutsideLayers(model_saved, logits_saved, logits_held, route, kept_outside, head_saved + loss_backward,
                          vocab_transient)


def _grad_x_bytes(setting):
    """Bytes a local token's input gradient takes while a block's backward sums it: head groups and ring steps
    add into fp32 (tsp.fp32_accumulators), cast once at the end; without, the model dtype, which is then the result
    itself. fp32 models have nothing narrower."""
    e, acc = setting.precision.element, setting.precision.accumulate
    return acc + 2 * e if setting.fp32_accumulators or e >= acc else 2 * e


def _tsp_mixer_transient(setting, tokens, shard, linear):
    """One TSP token mixer's backward buffers (``plan_tsp``'s detail), by name: an attention's or, ``linear``, the
    recurrent mixer's."""
    if linear:
        return _tsp_linear_transient(setting, tokens, shard)
    m, D = setting.model, setting.tsp_group_size
    e, acc, B = setting.precision.element, setting.precision.accumulate, setting.micro_batch
    S = tokens * D // B
    kv_heads = max(m.num_kv_heads // D, 1)
    q_heads = max(m.num_heads // D, 1)
    sums = acc if setting.fp32_accumulators else e
    if m.is_latent:
        # The gathered latent, its gather buffer, its gradient's sum and the reduce-scatter's stacked copy; one
        # head group's expansion under autograd: its keys/values and keys, and their gradients, every token.
        width, group = m.latent_width, q_heads * (m.qk_nope_head_dim + m.v_head_dim + m.head_dim)
        kv_head_group = B * S * (width * (3 * e + sums) + 2 * group * e)
    else:
        # backward of one head group: K, V, the gather buffer, the two dK/dV
        # copies in the model dtype and their sums (fp32 with tsp.fp32_accumulators), over the full sequence
        kv_head_group = 2 * B * S * kv_heads * m.head_dim * (4 * e + sums)
    return {
        "kv_head_group": kv_head_group,
        # of the local tokens, meanwhile: the group's queries before and after rotary, their output's gradient
        # and their own (with an output gate also the gate, its sigmoid, its gradient and the gated output); the
        # set's keys before rotary (for its backward) and, with another group to come, its keys and its K/V on
        # their way to the gather
        "head_group_local": tokens * m.head_dim * e * ((8 if m.attention_output_gate else 4) * q_heads
                                                       + (4 if D > 1 else 1) * kv_heads),
        "attention_shards_in_flight": 2 * shard * e,
        # every head group's gradient reduce stays posted until the attention's backward ends
        "attention_grad_reduces": m.attention_params * acc,
        "grad_x": tokens * m.hidden_size * _grad_x_bytes(setting),
    }


def _tsp_linear_transient(setting, tokens, shard):
    """A recurrent layer's backward buffers (``planning.recurrent``'s ``tsp_backward_buffers``), every rank's
    gradient reduces of its shard posted until the layer's backward ends, and the input's gradient."""
    m, p = setting.model, setting.precision
    buffers = m.recurrent.tsp_backward_buffers(p.element, setting.tsp_group_size, setting.micro_batch, tokens, shard)
    return {**buffers, "linear_grad_reduces": m.recurrent.params * p.accumulate,
            "grad_x": tokens * m.hidden_size * _grad_x_bytes(setting)}


def _tsp_mlp_transient(setting, tokens, tile, ffn_shard, sparse, schedule):
    """One TSP feed-forward block's backward buffers (``plan_tsp``'s detail), by name; a sparse block's under
    its ``schedule``."""
    m, D = setting.model, setting.tsp_group_size
    e, acc = setting.precision.element, setting.precision.accumulate
    if sparse and schedule == "all_to_all":
        return _tsp_experts_transient(setting, tokens, tile)
    if sparse:
        # One expert's tokens at a time (their expected count, k N / E, at most a tile), or a tile of the
        # shared expert.
        expert_tokens = min(tile, -(-m.experts_per_token * tokens // m.num_experts))
        intermediates = 6 * max(expert_tokens * m.expert_size, tile * m.shared_expert_size / D) * e
    else:
        intermediates = (8 if tile < tokens else 6) * tile * (m.intermediate_size / D) * e
    return {
        "mlp_shards_in_flight": 2 * ffn_shard * e,
        "mlp_accumulators": 3 * ffn_shard * acc,  # travelling, arriving, own partial
        # one shard's gradients of a tile (a sparse layer: of one expert's tokens);
        # tiled, also the tile's gate and up computed again
        "mlp_shard_intermediates": intermediates,
        "grad_x": tokens * m.hidden_size * _grad_x_bytes(setting),
    }


def _tsp_experts_transient(setting, tokens, tile):
    """A sparse block's backward buffers under the token all-to-all (``ds_tsp.blocks.moe.all_to_all``), by
    name: the routed rows' gradients, its experts' gradient summed at rest, one expert's rows at a time, and the
    shared expert's ring. An estimate from the code, not measured."""
    m, D, ep = setting.model, setting.tsp_group_size, setting.expert_group_size
    e, acc, k = setting.precision.element, setting.precision.accumulate, setting.model.experts_per_token
    shared, routed = m.shared_expert_params / D, m.num_experts * m.expert_params / ep
    # Every rank's rows for one of this rank's experts, k N ep / E expected, at most a tile.
    expert_rows = min(tile, -(-k * tokens * ep // m.num_experts))
    return {
        "mlp_shards_in_flight": 2 * shared * e,
        # the shared expert's ring accumulators; the routed experts' gradient summed in fp32, and its cast
        "mlp_accumulators": 3 * shared * acc + routed * (acc + e),
        "mlp_shard_intermediates": 6 * max(expert_rows * m.expert_size, tile * m.shared_expert_size / D) * e,
        # the rows' output gradients out to the experts' owners and in, their input gradients back and in
        "expert_rows_grads": 4 * k * tokens * m.hidden_size * e,
        "grad_x": tokens * m.hidden_size * _grad_x_bytes(setting),
    }


def _tsp_backward_phases(setting, mixer_saved, mlp_saved, mixer_pieces, mlp_pieces, every_layer):
    """The two peaks of one TSP layer's backward, each as ``(layer saved
    tensors still live, {term: buffer bytes})``: the MLP's backward, with
    every tensor the layer saved; then the token mixer's, once autograd has
    freed the MLP's (and its norm's) saved tensors. The layer is the
    recomputed one under checkpointing, else the last, with every layer's
    saved tensors (``every_layer``) live."""
    layer = mixer_saved + mlp_saved if setting.activation_checkpointing else every_layer
    mlp = {GRAD_X: mlp_pieces["grad_x"], MLP_TILE: mlp_pieces["mlp_shard_intermediates"],
           SHARDS: mlp_pieces["mlp_shards_in_flight"] + mlp_pieces["mlp_accumulators"],
           EXPERT_ROWS: mlp_pieces.get("expert_rows_grads", 0)}
    if "state_maps" in mixer_pieces:
        mixer = {STATE_MAPS: mixer_pieces["state_maps"], RECURRENT_LOCAL: mixer_pieces["head_group_local"],
                 GRAD_X: mixer_pieces["grad_x"],
                 SHARDS: mixer_pieces["linear_shards_in_flight"] + mixer_pieces["linear_grad_reduces"]}
    else:
        mixer = {KV_GROUP: mixer_pieces["kv_head_group"], HEAD_GROUP_LOCAL: mixer_pieces["head_group_local"],
                 GRAD_X: mixer_pieces["grad_x"],
                 SHARDS: mixer_pieces["attention_shards_in_flight"] + mixer_pieces["attention_grad_reduces"]}
    return (layer, mlp), (layer - mlp_saved, mixer)


def _tsp_peak(setting, vocab_parallel, states, outside, checkpoints, every_layer, live, layer_pieces):
    """``(memory parts, terms)``: the peak is the largest phase of backward, one
    layer's (``live`` saved tensors, ``layer_pieces`` buffers), the head's or
    the folded embedding's."""
    m, p = setting.model, setting.precision
    # The embedding's gradient, counted among the model states, is made last, by its own backward: no layer's
    # backward holds it. Not so a tied head's, ZeRO-3's partition (one buffer made once) or an offloaded
    # optimizer's (one layer's gradients at a time); a LoRA run's frozen embedding has none. ZeRO-2 holds its
    # partition over the data-parallel replicas.
    unmade = 0 if (m.tie_word_embeddings or setting.zero_stage >= 3 or setting.offload_optimizer
                   or setting.lora_rank) else _vocab_rows(setting, vocab_parallel) * m.hidden_size * p.grad
    unmade /= setting.tsp_replicas if setting.zero_stage == 2 else 1
    layer_backward = sum(layer_pieces.values()) - unmade
    # The head's phase is the first thing backward runs, before any parameter holds a gradient: it overlaps the
    # gradients' memory rather than adding to it. The embedding's runs last, with all of them.
    head_beyond_grads = loss_backward_beyond(setting, outside.head_phase_bytes, states)
    # With checkpointing no layer is recomputed yet while the loss runs its backward, and none is left when the
    # embedding runs its: the recomputed layer's saved tensors (counted in the activations) are not live then.
    # Without, every layer's are live while the loss runs its backward, those the layer's attention phase has
    # freed included.
    not_live = live if setting.activation_checkpointing else 0
    head_phase = max(head_beyond_grads - (not_live or live - every_layer), 0)
    embedding_backward = max(outside.transient.get("embedding_backward", 0) - not_live, 0)
    layer_terms = ({CHECKPOINT_BACK if setting.offload_activations else CHECKPOINTS: checkpoints,
                    RECOMPUTED: live} if setting.activation_checkpointing else {EVERY_LAYER: live})
    memory = {**states, "activations": outside.kept_outside + checkpoints + live, "logits": outside.logits_held,
              "transient": max(layer_backward, head_phase, embedding_backward)}
    # Where a layer's backward sets the peak, the model states in it lack the embedding's gradient.
    layer_binds = layer_backward >= max(head_phase, embedding_backward)
    terms = {STATES: sum(states.values()) - (unmade if layer_binds else 0), **layer_terms,
             KEPT_OUTSIDE: outside.kept_outside + outside.logits_held,
             **({k: v for k, v in layer_pieces.items() if v} if layer_binds else
                transient_terms({}, {HEAD_PHASE: head_phase, EMBEDDING_BACKWARD: embedding_backward}))}
    return memory, terms


# --- communication and FLOPs ---------------------------------------------------------------------

def _tsp_communication(setting, vocab_parallel, S, problem):
    """Bytes one rank receives: per layer forward and backward (the mean over
    the layers), per step, and per step by kind (``CommPart``); NaN where the
    shape does not fold. The sparse layers' all-to-all runs over the experts'
    group, the rest of ds_tsp's over the TSP group; DeepSpeed's over the replicas
    (``_replica_parts``)."""
    if problem:
        return float("nan"), float("nan"), float("nan"), {}
    m, B, D, e = setting.model, setting.micro_batch, setting.tsp_group_size, setting.precision.element
    options = {"moe_schedule": setting.moe_schedule, "expert_parallel_size": setting.expert_group_size}

    def layers(direction):
        return tsp_layers_bytes_by_op(m, S, B, D, e, direction, **options)

    by_op = tsp_step_bytes_by_op(m, S, B, D, e, vocab_parallel=vocab_parallel,
                                 activation_checkpointing=setting.activation_checkpointing, **options)
    experts = layers("both").get("all_to_all", 0) + \
        (layers("forward").get("all_to_all", 0) if setting.activation_checkpointing else 0)
    embedding = tsp_vocab_bytes_by_op(m, S, B, D, e, "both").get("all_to_all", 0) if vocab_parallel else 0
    parts = {TSP_PARTS[op]: CommPart(nbytes, D, 1, op)
             for op, nbytes in {**by_op, "all_to_all": embedding}.items() if nbytes}
    if experts:
        parts[TSP_EXPERT_ALL_TO_ALL] = CommPart(experts, setting.expert_group_size, 1, "all_to_all")
    replicas = _replica_parts(setting, vocab_parallel)
    per_step = sum(by_op.values()) + sum(part.nbytes for part in replicas.values())
    return (sum(layers("forward").values()) / m.num_layers, sum(layers("backward").values()) / m.num_layers,
            per_step, {**parts, **replicas})


def _replica_parts(setting, vocab_parallel):
    """DeepSpeed's bytes per step across TSP's data-parallel replicas, by kind: each rank's gradients reduced
    (reduce-scattered under ZeRO) over the ``dp`` ranks ``D`` apart that hold the same shards, folded experts'
    over their expert-data-parallel group ``ep`` apart; under ZeRO-1/2 the updated weights gathered back. LoRA
    runs reduce their adapters alone."""
    p, D, dp = setting.precision, setting.tsp_group_size, setting.tsp_replicas
    ep, edp = setting.expert_group_size, setting.expert_replicas
    if dp == 1:
        return {}
    held = _held_params(setting, vocab_parallel)
    trained = (held.adapters if setting.lora_rank else held.params) + \
        (setting.vision.held_params(D) if setting.vision else 0)  # the tower's shards too
    experts = 0 if setting.lora_rank else _held_experts(setting)
    reduce_op = "reduce_scatter" if setting.zero_stage >= 1 else "all_reduce"

    def received(group, nbytes, op):  # a ring all-reduce receives 2 (g-1)/g of the tensor, the others (g-1)/g
        return (2 if op == "all_reduce" else 1) * (group - 1) / group * nbytes

    parts = {GRAD_REDUCE: CommPart(received(dp, (trained - experts) * p.grad, reduce_op), dp, D, reduce_op),
             EXPERT_GRAD_REDUCE: CommPart(received(edp, experts * p.grad, reduce_op), edp, ep, reduce_op)}
    if setting.zero_stage in (1, 2):
        parts[PARAM_GATHER] = CommPart(received(dp, (trained - experts) * p.element, "all_gather"), dp, D,
                                       "all_gather")
        parts[EXPERT_PARAM_GATHER] = CommPart(received(edp, experts * p.element, "all_gather"), edp, ep,
                                              "all_gather")
    return {name: part for name, part in parts.items() if part.nbytes}


def _with_tower(setting, memory, terms, host):
    """``(memory, terms, host, visual.tower_summary)`` with the vision tower one rank holds and runs: ``ceil(numel / D)`` of each
    unit (ZeRO-1/2 partitioning them over the replicas), its share of the patches, ``1/D``, and the
    gathered units autograd keeps for backward (``ds_tsp.blocks.tower``: all of them, or where the blocks are
    checkpointed the others alone); one unit gathered whole in backward, with its gradient."""
    v, D, e = setting.vision, setting.tsp_group_size, setting.precision.element
    kept_units = sum(v.unit_numels) - (sum(v.recomputed_numels) if setting.activation_checkpointing else 0)
    tower = tower_memory(setting, v.held_params(D), setting.tsp_replicas, setting.patches / D,
                         saved_weights=kept_units * e if D > 1 else 0, gathered=D > 1)
    memory, terms = add_tower(memory, terms, tower)
    if tower.host:
        host = {**host, HOST_OPTIMIZER: host[HOST_OPTIMIZER] + setting.ranks_per_node * tower.host}
    summary = tower_summary(tower, setting.patches / D, v.held_params(D), _tsp_tower_parts(setting),
                            tower_flops(setting, setting.patches / D)[0])
    return memory, terms, host, summary


def _tsp_tower_parts(setting):
    """The tower's bytes one rank receives per step, by kind (``visual.tsp_visual_bytes_by_op``, the rows
    spread evenly over the ranks)."""
    v, D = setting.vision, setting.tsp_group_size
    by_op = tsp_visual_bytes_by_op(v.unit_numels, v.text_hidden_size, setting.micro_batch * setting.visual_tokens,
                                   D, setting.precision.element, features=v.features,
                                   recomputed_numels=v.recomputed_numels if setting.activation_checkpointing else ())
    kinds = {"all_gather": VISION_GATHER, "reduce_scatter": VISION_GRADS, "all_to_all": VISION_ROWS}
    return {kinds[op]: CommPart(float(nbytes), D, 1, op) for op, nbytes in by_op.items() if nbytes}


def _tsp_flops(setting, vocab_parallel, S, tokens, schedule):
    """``(FLOPs, attention FLOPs)`` per rank per step: the replica's over ``D``; ``schedule``: the sparse
    layers' (``_moe_schedule``)."""
    m = setting.model
    tiled = _token_tile(setting, tokens) < tokens

    def recomputed(sparse):
        # Backward runs again, where the local tokens run in several tiles: the MLP's gate and up projections, a
        # routed expert's gate and up (its output never: the routing weights' gradient is read off its input
        # gradient on the ring, and the all-to-all kept it). The shared expert runs again whole on the expert
        # ring (its gate's gradient reads its output), and its gate and up where tiled on the MLP's ring (under
        # the all-to-all).
        if not sparse:
            return 2 / 3 * m.mlp_params if tiled else 0
        gate_up = m.expert_params - m.hidden_size * (m.expert_size + int(m.expert_bias))
        routed = m.experts_per_token * gate_up if tiled else 0
        if schedule == "ring":
            return routed + m.shared_expert_params
        return routed + (2 / 3 * m.shared_expert_params if tiled else 0)

    return step_flops(m, setting, setting.micro_batch, S, 1 / setting.tsp_group_size, tsp=True,
                      fused_head=vocab_parallel, ffn_recompute=recomputed, projections_recomputed=tiled)
