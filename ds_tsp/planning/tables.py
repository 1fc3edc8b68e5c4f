"""What ``ds-tsp plan`` prints and draws: the per-strategy table (with the
paper's measured peaks beside it, and each strategy's step time on a cluster),
a mixture-of-experts model's facts (parameters, expert bytes per device, the
expert ring against the token all-to-all), the longest-sequence table (with
ALST's published lengths beside it), the step-time model against published
throughput, and peak memory against sequence length."""

import math
from dataclasses import replace

from ds_tsp.planning.anchors import ALST_HOST_MEMORY_GB, ALST_PUBLISHED, PAPER_DEVICE_GB, PAPER_LABELS, PAPER_SETTING
from ds_tsp.planning.communication import (
    gradient_wire_bytes,
    moe_crossover_tokens,
    tsp_moe_bytes_by_op,
    tsp_moe_schedule,
)
from ds_tsp.planning.kernels import device
from ds_tsp.planning.longest import fpdt_published
from ds_tsp.planning.memory import MEMORY_PARTS
from ds_tsp.planning.shapes import DEFAULT_LOGITS_TILE_MIB, GB, model_shape, padded_length, tsp_name, tsp_shape_problem
from ds_tsp.planning.strategies import alst_name, plan
from ds_tsp.planning.timing import DEFAULT_CLUSTER, step_time


def format_gb(nbytes):
    return f"{nbytes / GB:.1f}"


def _paper_footer(plans, paper):
    setting = plans[0].setting
    by_name = {p.name: p for p in plans}
    lines = []
    expected = {**PAPER_SETTING, "model": model_shape(PAPER_SETTING["model"])}
    ours = dict(model=replace(setting.model, name=expected["model"].name), seq_len=setting.seq_len,
                micro_batch=setting.micro_batch, devices=setting.devices, dtype=setting.dtype)
    if ours != expected:
        lines.append("WARNING: the paper's numbers are for llama-7b, S=131072, B=1, 8 devices, bf16; this table "
                     "is for another setting, so the two columns do not compare.")
    ratios = {n: paper[n] * GB / by_name[n].total for n in paper if n in by_name}
    if ratios:
        lines.append(f"Paper column: peak GB/GPU measured on MI300X by the paper; its 140.0 GB layout is TP+SP with "
                     f"t=1 x c=8 (= SP-Ulysses(8) here) and its 85.0 GB layout t=2 x c=4, inferred from their model "
                     f"states (16P/t = {16 * setting.model.params / 2 / GB:.0f} and "
                     f"{16 * setting.model.params / GB:.0f} GB leave about 31 GB of activations each).")
        lines.append("Difference, measured / estimated: " + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()) +
                     ". The estimate counts tensors only: no caching-allocator reserve or fragmentation, no "
                     "RCCL/NCCL or kernel workspaces, no fp32 gradient-accumulation buffers, and it models ds_tsp's "
                     "TSP, not the paper's implementation, whose buffers are not published.")
    if setting.activation_checkpointing:
        unckpt = {p.name: p for p in plan(setting.model, setting.seq_len, setting.micro_batch, setting.devices,
                                          setting.dtype, setting.zero_stage, activation_checkpointing=False,
                                          tsp_attention_backward=setting.tsp_attention_backward)}
        tp = unckpt.get(f"TP({setting.devices})")
        lines.append(f"Assumed, as the paper must: full activation checkpointing for every strategy; without it "
                     f"TP({setting.devices}) alone would need {format_gb(tp.total)} GB per GPU "
                     f"(> {PAPER_DEVICE_GB} GB on an MI300X) against the paper's 70.0.")
    tsp, tp = by_name.get(tsp_name(setting.devices, False)), by_name.get(f"TP({setting.devices})")
    paper_hybrids = sorted((p for p in plans if p.name in paper and p not in (tsp, tp)), key=lambda p: p.total)
    folded = by_name.get(tsp_name(setting.devices))
    if tsp and folded:
        lines.append(f"The paper describes TSP schedules for attention and the gated MLP only, so its TSP is set "
                     f"beside {tsp.name}; with the vocabulary folded as well (ds_tsp's default) {folded.name} "
                     f"needs {format_gb(folded.total)} GB.")
    if tsp and tp and paper_hybrids:
        holds = tsp.total < tp.total < paper_hybrids[0].total
        lines.append(f"Ordering TSP < TP < the paper's TP+SP layouts: {'reproduced' if holds else 'NOT reproduced'} "
                     f"({format_gb(tsp.total)} < {format_gb(tp.total)} < "
                     f"{' / '.join(format_gb(p.total) for p in paper_hybrids)} GB).")
        for hybrid in (p for p in plans if p.name.startswith("TP+SP") and p.name not in paper):
            if hybrid.total <= tp.total:
                states = sum(hybrid.memory[k] - tp.memory[k] for k in ("weights", "grads", "optimizer"))
                lines.append(f"{hybrid.name} ({hybrid.layout}), not one of the paper's layouts, comes out below "
                             f"TP({setting.devices}) here ({format_gb(hybrid.total)} GB): splitting the sequence saves "
                             f"{format_gb(tp.memory['activations'] - hybrid.memory['activations'])} GB of TP's replicated "
                             f"activations for {format_gb(states)} GB more model states.")
    return lines


def format_table(plans, paper=None, cluster=DEFAULT_CLUSTER):
    """Markdown table of ``plans`` (from one ``plan`` call) with a footer of the
    assumptions; ``paper`` (``{plan name: GB}``, e.g. ``PAPER_PEAK_GB``) adds a
    column; the last columns are ``timing.step_time`` on ``cluster``."""
    setting = plans[0].setting
    m, p, D, dp = setting.model, setting.precision, setting.tsp_group_size, setting.tsp_replicas
    head = ["strategy", "layout", "weights", "grads", "optim", "activ", "logits", "transient", "**peak GB**"]
    if paper:
        head.append("paper GB")
    head += ["fwd MB/layer", "bwd MB/layer", "GB/step", "TFLOP/step", "s/step", "tok/s/GPU", "bound"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for plan_ in plans:
        cells = [plan_.name + ("" if plan_.feasible else " (infeasible)") + (" (not exact)" if plan_.inexact else ""),
                 plan_.layout]
        cells += [format_gb(plan_.memory[k]) for k in MEMORY_PARTS] + [f"**{format_gb(plan_.total)}**"]
        if paper:
            value = paper.get(plan_.name)
            cells.append("" if value is None else f"{value:.1f}" + (f" ({PAPER_LABELS[plan_.name]})"
                                                                      if plan_.name in PAPER_LABELS else ""))
        cells += [f"{plan_.comm_forward_per_layer / 1e6:.1f}", f"{plan_.comm_backward_per_layer / 1e6:.1f}",
                  f"{plan_.comm_per_step / GB:.1f}", f"{plan_.flops_per_step / 1e12:.0f}"]
        time = step_time(plan_, cluster)
        cells += [f"{time.seconds:.3g}", f"{time.tokens_per_s_per_device:,.0f}", time.bound] if plan_.feasible \
            else ["", "", ""]
        rows.append("| " + " | ".join(cells) + " |")
    footer = [
        f"{m.name}: {m.params / 1e9:.2f}B params, L={m.num_layers}, H={m.hidden_size}, F={m.intermediate_size}, "
        f"heads {m.num_heads}/{m.num_kv_heads}, d={m.head_dim}"
        + (f" (latent attention: q_lora_rank {m.q_lora_rank}, kv_lora_rank {m.kv_lora_rank}, rotary "
           f"{m.qk_rope_head_dim}, values {m.v_head_dim}"
           + (f"; sparse: a lightning indexer of {m.index_heads} heads of {m.index_head_dim} chooses "
              f"{m.index_topk} keys a query" + (f", {m.shared_index_layers} layers reusing an earlier layer's choice"
                                                if m.shared_index_layers else "") if m.index_topk else "")
           + ")" if m.is_latent else "")
        + (f"; {m.global_layers} full layers of heads {m.num_heads}/{m.global_num_kv_heads}, d={m.global_head_dim}"
           + (", keys as values" if m.global_values_from_keys else "") if m.global_layers else "")
        + (" (gated attention)" if m.attention_output_gate else "")
        + (f"; {m.linear_layers} of the {m.num_layers} layers {m.recurrent.describe()}" if m.is_hybrid else "")
        + (f"; layers of one block: {m.mixer_only_layers} mix tokens, {m.ffn_only_layers} feed forward"
           if m.one_block_layers else "") + ", "
        f"V={m.vocab_size}; S={setting.seq_len}, B={setting.micro_batch}, {setting.devices} devices, "
        f"{setting.dtype}, ZeRO-{setting.zero_stage}, activation checkpointing "
        f"{'on' if setting.activation_checkpointing else 'off'}, TSP attention backward "
        f"{setting.tsp_attention_backward}.",
        f"Memory per device, GB = 1e9 B: model states {p.weight + p.grad + p.optimizer} B/param "
        f"({p.weight} weight + {p.grad} grad + {p.optimizer} optimizer), ZeRO over the weight-replica axis only; "
        f"activations = tensors saved for backward (HF Llama layer, flash attention, for the baselines; "
        f"ds_tsp's own saved tensors for TSP); logits = output + fp32 log-probs; transient = max(loss backward, "
        f"one layer's backward buffers).",
        f"TSP vocabulary: {tsp_name(D, True, dp)} folds it (tsp.vocab_parallel, the default): each rank holds "
        f"ceil(V/D) rows of the embedding and the LM head, and the fused head + loss keeps no logits, only the labels "
        f"and fp32 log-sum-exp, with {setting.logits_tile_mib:g} MiB fp32 logits tiles (tsp.logits_tile_mib); "
        f"{tsp_name(D, False, dp)} keeps both whole on every rank (vocab_parallel false).",
        "Communication: bytes received per device (ring all-reduce 2(p-1)/p, all-gather / reduce-scatter / "
        "all-to-all (p-1)/p, broadcast 1 per non-owner, reduce (p-1) at the owner); per step = L x (fwd + bwd"
        + (" + recomputed fwd" if setting.activation_checkpointing else "") + ") + embedding/head/replicated syncs.",
        "TSP per layer (elements, x dtype bytes): fwd (D-1)/D (Wa + Wm + 2BS nkv d); bwd = fwd + (D-1)/D (Wa + Wm) "
        "in fp32 (gradient reduce, ring accumulators) + (D-1)/D 2BS nkv d (dK, dV reduce-scatter). Folded vocabulary, "
        "per step: embedding all-to-all (D-1)/D BSH/D fwd and bwd, LM-head ring (D-1) ceil(V/D) H fwd and bwd + the "
        "same in fp32 bwd (gradient accumulators); replicated vocabulary: the embedding and head gradients "
        "all-reduced instead." + (" A sparse layer has its experts and shared expert, Wx = 3H (E F_e + F_s), on "
                                  "the ring in Wm's place." if m.is_moe else "")
        + (f" Latent attention: the latent and rotary key, {m.latent_width} elements a token for all heads, take "
           f"2 nkv d's place (a per-head K/V would be {m.num_heads * (m.head_dim + m.value_dim)}); each rank expands "
           f"it into every head group's K/V (FLOPs counted), the baselines attend the expanded heads."
           + (f" Its index keys, {m.index_head_dim} elements a token, join the latent's forward gather, and its "
              "indexer's pieces are broadcast in forward only (they take no gradient)." if m.index_heads else "")
           if m.is_latent else "")
        + (f" A {m.recurrent.kind} layer has no K/V: its weights are broadcast as the attention's are, and the "
           "ranks all-gather their chunks' state maps, float32 (and their initial-state gradients backward), "
           "whatever the sequence length." if m.is_hybrid else "")
        + (" Per-layer figures are the mean over the layers." if m.is_moe or m.is_hybrid else ""),
        f"Time (timing): {cluster.describe()}, {setting.devices_per_node} devices per node. s/step = blocking "
        "communication + max(compute, overlapped communication per link); TP all-reduces, Ulysses all-to-alls, "
        "ZeRO-1/2's weight gather and TSP's embedding all-to-all and replicated-gradient all-reduces block; ZeRO-3 "
        "gathers, gradient reduction, context-parallel K/V and TSP's weight broadcasts, ring and K/V gathers "
        "overlap. A group spanning nodes runs at the inter-node bandwidth. tok/s/GPU = B x S / (devices per "
        "replica) / s/step. Bound: the busiest of compute, the intra-node and the inter-node link. Attention, "
        "matmuls and elementwise work run at the device's published kernel rates (--time-anchors sets them beside "
        "published runs).",
    ]
    options = [f"tsp.token_tile {setting.token_tile}" if setting.token_tile else "",
               "" if setting.fp32_accumulators else "tsp.fp32_accumulators false",
               "checkpoints in host memory (cpu_checkpointing)" if setting.offload_activations else "",
               "optimizer offloaded to the CPU" if setting.offload_optimizer else ""]
    if any(options):
        hosts = ", ".join(f"{p.name} {format_gb(p.host_total)}" for p in plans if p.host_total)
        footer.append("Options: " + ", ".join(o for o in options if o) + "." +
                      (f" Host memory per node of {setting.ranks_per_node} ranks, GB: {hosts}." if hosts else ""))
    footer += _replicas_footer(plans)
    inexact = [plan_ for plan_ in plans if plan_.inexact]
    if inexact:
        footer.append(f"Not exact: {', '.join(plan_.name for plan_ in inexact)} train another model than "
                      f"{m.name}: DeepSpeed's sequence parallelism swaps the attention alone, so {inexact[0].inexact}. "
                      f"Their rows are what that costs (each rank running the recurrent layers on its tokens with the "
                      f"whole weights, ZeRO-3 gathering them where it partitions them), not a way to train "
                      f"{m.name}; TP, DP, CP-heads (Megatron's head all-to-all) and TSP are exact.")
    if paper:
        footer += _paper_footer(plans, paper)
    return "\n".join(rows) + "\n\n" + "\n".join(f"* {line}" for line in footer) + "\n"

def format_tower_table(plans):
    """Markdown table of a vision-language model's tower on one device of each plan (``StrategyPlan.tower``):
    the patches it encodes, the parameters it holds (before ZeRO partitions them), its model states, the
    tensors it keeps for backward, its own backward's peak buffers, its bytes received and FLOPs per step;
    with a footer of what is assumed."""
    setting = plans[0].setting
    v, D = setting.vision, setting.tsp_group_size
    head = ["strategy", "patches", "params held (M)", "states GB", "saved GB", "backward GB", "GB/step", "TFLOP/step"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for plan_ in plans:
        tower = plan_.tower
        if not tower:
            continue
        rows.append("| " + " | ".join([
            plan_.name, f"{tower['patches']:,.0f}", f"{tower['params_held'] / 1e6:,.0f}", format_gb(tower["states"]),
            format_gb(tower["activations"]), format_gb(tower["backward"]), f"{tower['comm_per_step'] / GB:.1f}",
            f"{tower['flops_per_step'] / 1e12:.0f}"]) + " |")
    frames = setting.visual_tokens / setting.frame_tokens
    footer = [
        f"Vision tower: {v.params / 1e6:,.0f}M parameters with its mergers, {v.layers} blocks of {v.hidden_size} "
        f"(MLP {v.intermediate_size}, {v.num_heads} heads), {v.patches_per_token} patches a visual token, "
        f"{v.features} row(s) of {v.text_hidden_size} a token to the decoder; {frames:g} frames x "
        f"{setting.frame_tokens} tokens = {setting.visual_tokens:,} visual tokens of each sequence's "
        f"{setting.seq_len:,}, {setting.patches:,} patches a micro-batch. Its terms are in the table above "
        f"(model states, saved tensors; its backward where it sets the peak).",
        f"TSP({D}): each rank encodes about 1/{D} of the patches, holds ceil(numel/{D}) of each of the tower's "
        f"{len(v.unit_numels)} units (all-gathered in forward and, checkpointed, again in backward; their "
        f"gradients reduce-scattered) and keeps the gathered units autograd saves; the merged rows go to their "
        f"placeholders' ranks by one all-to-all (ds_tsp.blocks.tower, DESIGN.md 6m).",
        "Assumed for the others: the tower runs whole on every device of a model replica over ALL the "
        "micro-batch's patches (DeepSpeed-Ulysses takes a text config only; verl's Ulysses path runs the whole tower "
        "for every image on every rank); ZeRO partitions its states over the weight replicas as the decoder's "
        "(ZeRO-3 gathering it in forward and backward); TP does not split it.",
        "Saved tensors per patch and block: 8 e h + 16 + 4 a + 2 e F (gated MLP: 4 e F), the mergers 4 e h a "
        "feature; checkpointed, each block keeps its input (e h) and runs again in the tower's backward, which "
        "runs last (visual.tower_memory).",
    ]
    return "Vision tower per device:\n\n" + "\n".join(rows) + "\n\n" + "\n".join(f"* {line}" for line in footer) + "\n"


def _replicas_footer(plans):
    """The footer lines of TSP rows with data-parallel replicas beside their group, and of folded experts."""
    setting = plans[0].setting
    m, D, dp = setting.model, setting.tsp_group_size, setting.tsp_replicas
    footer = []
    if dp > 1:
        footer.append(f"TSP x DP: the TSP rows' group is {D} of the {setting.devices} devices, {dp} data-parallel "
                      f"replicas beside it; ZeRO-{setting.zero_stage} partitions over them, and DeepSpeed reduces "
                      f"the gradients over them (overlapped)"
                      + (" and gathers the updated weights (blocking)" if setting.zero_stage in (1, 2) else "") + ".")
    for plan_, ep in _folded(plans):
        footer.append(f"Experts folded (tsp.expert_parallel_size {ep}): {plan_.name} holds {m.num_experts // ep} "
                      f"of the {m.num_experts} experts a layer and meets them by the token all-to-all over {ep} "
                      f"consecutive ranks (blocking), the shared expert on the TSP ring; their gradients are reduced "
                      f"and ZeRO partitions their states over the ranks holding the same experts, "
                      f"{setting.devices // ep} (the expert-data-parallel group), the rest's over the {dp} replicas. "
                      f"The all-to-all keeps the rows it exchanged for backward, 2 k H elements a local token and "
                      f"sparse layer.")
    return footer


def moe_facts(setting):
    """A mixture-of-experts model's facts at ``setting`` (None for a dense model):
    total and active parameters, the routed experts' weight bytes on one
    device under TSP (``E/D`` experts a layer), TP (``1/t`` of each) and the
    layouts that replicate them (AutoTP among them), and one sparse layer's bytes received per
    rank and step (forward + backward) by the expert ring and by the token
    all-to-all, the micro-batch size in tokens where they cross, and the one
    ``tsp.moe_schedule: "auto"`` picks at this shape."""
    m, N, p = setting.model, setting.devices, setting.precision
    D, dp = setting.tsp_group_size, setting.tsp_replicas
    if not m.is_moe:
        return None
    e, B, S = p.element, setting.micro_batch, padded_length(setting.seq_len, D)
    experts = m.routed_expert_params * p.weight
    facts = {"params": m.params, "active_params": m.active_params, "moe_layers": m.moe_layers,
             "num_experts": m.num_experts, "experts_per_token": m.experts_per_token, "expert_size": m.expert_size,
             "shared_expert_size": m.shared_expert_size, "routed_expert_bytes": experts,
             "expert_bytes_per_device": {tsp_name(D, True, dp): experts / D, f"TP({N})": experts / N,
                                         f"AutoEP({math.gcd(m.num_experts, N)})":
                                             experts / math.gcd(m.num_experts, N),
                                         f"SP-Ulysses({N})": experts}}
    if D > 1 and tsp_shape_problem(m, D) is None:
        a = gradient_wire_bytes(e)
        facts["sparse_layer_bytes"] = {schedule: sum(tsp_moe_bytes_by_op(m, S, B, D, e, "both", schedule).values())
                                       for schedule in ("ring", "all_to_all")}
        facts["crossover_tokens"] = {direction: moe_crossover_tokens(m, D, e, direction)
                                     for direction in ("both", "forward")}
        facts["auto_schedule"] = tsp_moe_schedule(m, S, B, D, e)
        facts["accumulator_bytes"] = a
    return facts


def format_moe_facts(plans):
    """Lines for a mixture-of-experts model (``moe_facts``), "" for a dense one."""
    setting = plans[0].setting
    facts, m, N = moe_facts(setting), setting.model, setting.devices
    if facts is None:
        return ""
    D, tsp = setting.tsp_group_size, tsp_name(setting.tsp_group_size, True, setting.tsp_replicas)
    shared = f", a shared expert of F_s={m.shared_expert_size}" if m.shared_expert_size else ", no shared expert"
    per_device, ep = facts["expert_bytes_per_device"], math.gcd(m.num_experts, N)
    lines = [
        f"{m.name}: {m.moe_layers} of {m.num_layers} layers sparse, {m.num_experts} experts of F_e={m.expert_size}, "
        f"top-{m.experts_per_token}{shared}: {m.params / 1e9:.2f}B total, {m.active_params / 1e9:.2f}B active "
        f"parameters per token; the routed experts are {m.routed_expert_params / 1e9:.2f}B "
        f"({format_gb(facts['routed_expert_bytes'])} GB of {setting.dtype} weights).",
        f"Routed-expert weights per device, GB: {tsp} {format_gb(per_device[tsp])} "
        f"({m.num_experts // D if m.num_experts % D == 0 else m.num_experts / D:g} of {m.num_experts} experts a "
        f"layer)" + "".join(f"; {plan_.name} {format_gb(facts['routed_expert_bytes'] / ep_)} ({m.num_experts // ep_} "
                           f"a layer, folded across the replicas)" for plan_, ep_ in _folded(plans))
        + f"; TP({N}) {format_gb(per_device[f'TP({N})'])} (1/{N} of every expert's F_e, Megatron's expert "
        f"tensor parallelism, modelled); AutoEP({ep}) {format_gb(per_device[f'AutoEP({ep})'])} ({m.num_experts // ep} "
        f"experts a layer, tokens to them by all-to-all, everything else data parallel); SP-Ulysses({N}), CP, DP "
        f"and AutoTP({N}) "
        f"{format_gb(per_device[f'SP-Ulysses({N})'])} (every expert on every device: AutoTP splits what the "
        f"model's Hugging Face tp_plan names, its attention; ZeRO-3 partitions them and gathers one layer's whole "
        f"at a time).",
    ]
    if "sparse_layer_bytes" in facts:
        moved, cross = facts["sparse_layer_bytes"], facts["crossover_tokens"]
        tokens = setting.micro_batch * setting.seq_len
        cheaper = {"ring": "expert ring", "all_to_all": "token all-to-all"}[facts["auto_schedule"]]
        lines.append(
            f"One sparse layer, bytes received per rank and step (forward + backward, {setting.dtype}, gradient "
            f"accumulators in {facts['accumulator_bytes']} B): expert ring {moved['ring'] / 1e6:.1f} MB, whatever "
            f"the tokens; token all-to-all (routing spread evenly) {moved['all_to_all'] / 1e6:.1f} MB at B x S = "
            f"{tokens:,} tokens. The {cheaper} is cheaper here, and tsp.moe_schedule \"auto\" (the default) "
            f"picks it (\"{facts['auto_schedule']}\"); the ring moves fewer bytes past {cross['both']:,.0f} tokens "
            f"per micro-batch, the all-to-all below ({cross['forward']:,.0f} counting the forward alone).")
        for plan_, ep_ in _folded(plans):
            folded = tsp_moe_bytes_by_op(m, padded_length(setting.seq_len, D), setting.micro_batch, D,
                                         setting.precision.element, "both", "all_to_all", expert_parallel_size=ep_)
            lines.append(f"{plan_.name}: the token all-to-all over {ep_} ranks, {sum(folded.values()) / 1e6:.1f} MB "
                         f"received per rank, sparse layer and step (forward + backward; no ring for its experts, "
                         f"spread over more ranks than the TSP group).")
    else:
        lines.append(f"TSP({D}) cannot shard this model: {tsp_shape_problem(m, D) or 'one device moves nothing'}.")
    return "Mixture of experts:\n\n" + "\n".join(f"* {line}" for line in lines) + "\n"


def _folded(plans):
    """``(plan, ep)`` of the plans whose experts fold across data-parallel replicas."""
    return [(plan_, plan_.setting.expert_group_size) for plan_ in plans
            if plan_.setting.expert_group_size > plan_.setting.tsp_group_size]


def plot_memory_vs_seq(model, seq_lens, devices, path, micro_batch=1, dtype="bf16", zero_stage=0,
                       activation_checkpointing=False, memory_per_device_bytes=None, tsp_attention_backward=None,
                       logits_tile_mib=DEFAULT_LOGITS_TILE_MIB, **options):
    """PNG at ``path``: per-device peak memory against sequence length, one line
    per strategy (log-log), with the device memory as a dashed line if given;
    ``options`` as ``plan``'s."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    seq_lens = sorted(seq_lens)
    curves = {}
    for seq_len in seq_lens:
        for plan_ in plan(model, seq_len, micro_batch, devices, dtype, zero_stage, activation_checkpointing,
                          tsp_attention_backward, logits_tile_mib, **options):
            curves.setdefault(plan_.name, []).append(plan_.total / GB)
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, totals in curves.items():
        ax.plot(seq_lens, totals, marker="o", label=name, linewidth=2.5 if name.startswith("TSP") else 1.2)
    if memory_per_device_bytes:
        ax.axhline(memory_per_device_bytes / GB, color="black", linestyle="--", label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per device (GB)")
    ax.set_title(f"{model_shape(model).name}, {devices} devices, B={micro_batch}, {dtype}, ZeRO-{zero_stage}"
                 + (", checkpointing" if activation_checkpointing else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _tokens_text(seq_len):
    return f"{seq_len:,} ({seq_len / 1e6:.2f}M)"


def _per_token_kb(result):
    """The device terms of ``result`` at its limit, KB per local token, largest first."""
    tokens = result.plan.tokens_per_device
    return ", ".join(f"{name} {nbytes / tokens / 1e3:.1f}"
                     for name, nbytes in sorted(result.plan.terms.items(), key=lambda item: -item[1]))


def format_longest_table(results, memory_gb, host_memory_gb):
    """Markdown table of ``longest.max_seq_len``'s ``results`` (one setting):
    each strategy's longest sequence, its binding term and its memory there,
    with ALST's published length where the setting is ALST's, and a footer of
    the assumptions and of TSP against ALST."""
    setting = results[0].plan.setting
    m, N = setting.model, setting.devices
    head = ["strategy", "layout", "longest sequence", "binding term", "device GB", "host GB/node", "ALST published"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for result in results:
        if result.limit == "shape":
            length = "cannot run"
        else:
            length = _tokens_text(result.seq_len) if result.seq_len else f"none (not even {result.step})"
        binding = result.binding + (" (host)" if result.limit == "host" else "")
        rows.append("| " + " | ".join([
            result.name + (" (not exact)" if result.plan.inexact else ""), result.layout, length, binding,
            format_gb(result.device_bytes), format_gb(result.host_bytes),
            "" if result.published is None else _tokens_text(result.published)]) + " |")
    footer = [
        f"{m.name}: {m.params / 1e9:.2f}B params, L={m.num_layers}, H={m.hidden_size}, F={m.intermediate_size}, "
        f"heads {m.num_heads}/{m.num_kv_heads}, V={m.vocab_size}; {N} devices x {memory_gb:g} GB, "
        f"{host_memory_gb:g} GB host memory per node of {setting.ranks_per_node}, B={setting.micro_batch}, "
        f"{setting.dtype}, activation checkpointing for every strategy.",
        "Longest sequence: the largest multiple of the strategy's step (2N for TSP's zigzag, the sequence-parallel "
        "size for Ulysses, 1 for TP) whose planned peak fits the device and whose offloads fit the host, found by "
        "doubling then bisection; the next multiple does not fit. Binding term: the largest term of the budget the "
        "next length breaks. Device GB / host GB: at the longest length. The peak counts tensors only (no "
        "allocator reserve, fragmentation or communication workspaces).",
    ]
    if host_memory_gb == ALST_HOST_MEMORY_GB:
        footer.append(f"Host memory {ALST_HOST_MEMORY_GB:g} GB per node is assumed (a DGX H100's 2 TB): neither "
                      f"DESIGN.md nor ALST's published figures give its nodes' host memory.")
    by_name = {r.name: r for r in results}
    alst, tsp = by_name.get(alst_name(N)), by_name.get(tsp_name(N) + " + offload")
    if alst is not None and alst.published:
        footer.append(f"ALST published {_tokens_text(alst.published)} for this setting; the planner's model of "
                      f"ALST gives {_tokens_text(alst.seq_len)} ({alst.seq_len / alst.published:.2f}x).")
    if tsp is not None and alst is not None and tsp.seq_len and alst.seq_len:
        anchor = alst.published or alst.seq_len
        footer.append(f"{tsp.name}: {tsp.seq_len / anchor:.2f}x ALST's "
                      f"{'published' if alst.published else 'modelled'} length. Per local token at the limit, KB: "
                      f"{tsp.name}: {_per_token_kb(tsp)}; ALST: {_per_token_kb(alst)}.")
    fpdt = fpdt_published(m, N, memory_gb, setting.micro_batch, setting.dtype)
    if fpdt and tsp is not None:
        footer.append(f"FPDT published {_tokens_text(fpdt)} for an 8B model of this shape on {N} x {memory_gb:g} GB: "
                      f"{tsp.name} is {tsp.seq_len / fpdt:.2f}x it.")
    if alst is not None and alst.published is None:
        footer.append(f"ALST published lengths are for Llama-3.1-8B on "
                      f"{', '.join(str(n) for n in ALST_PUBLISHED)} x 80 GB, B=1, bf16 only.")
    return "\n".join(rows) + "\n\n" + "\n".join(f"* {line}" for line in footer) + "\n"


def format_time_anchors(comparisons):
    """Markdown table of ``timing.compare_anchors``: each published run's
    throughput beside the model's, counted as the source counts FLOPs: the
    kernels alone, and with the framework overhead fitted to all the runs (in
    sample) and to the others (left out); a footer of the sources, their
    settings and what is assumed."""
    head = ["published run", "modelled as", "kernels", "published TFLOPs/GPU", "model TFLOPs/GPU",
            "model / published", "in sample", "left out", "published s/step", "model s/step", "bound",
            "exposed comm"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        a = c.anchor
        kernels = f"{a.cluster['device']} {a.cluster['attention_kernel']}, {a.cluster.get('matmul_dtype', 'bf16')}"
        rows.append("| " + " | ".join([
            a.label, c.plan.layout, kernels,
            f"{a.tflops:.1f}" + ("" if a.published_tflops is not None else " (from tokens/s)"),
            f"{c.tflops(1.0):.1f}", f"{c.ratio(1.0):.2f}", f"{c.ratio(c.in_sample):.2f}",
            f"{c.ratio(c.left_out):.2f}" if a.in_fit else "(not fitted)",
            f"{a.seconds:.2f}" + ("" if a.published_seconds is not None else " (from TFLOPs)"),
            f"{c.seconds(1.0):.2f}", c.time.bound, f"{c.time.exposed_comm / c.time.seconds:.0%}"]) + " |")
    footer, seen = [], set()
    for c in comparisons:
        if c.anchor.source not in seen:
            seen.add(c.anchor.source)
            footer.append(f"{c.anchor.source}: counted as {c.anchor.count_flops.__name__} (anchors); assumed: "
                          f"{c.anchor.assumed}.")
    for name in sorted({c.anchor.cluster["device"] for c in comparisons}):
        footer.append(f"{name.upper()} kernel rates: {device(name).sources}.")
    fitted = [c for c in comparisons if c.anchor.in_fit]
    within = [c for c in comparisons if 0.8 <= c.ratio(1.0) <= 1.25]
    left_out = [c.ratio(c.left_out) for c in fitted]
    footer += [
        "Kernels: the device, attention kernel and matmul dtype the run is priced with (kernels.DEVICES: "
        "FlashAttention's and cuDNN's published attention rates by head size and length, the best achievable "
        "matmul rate, HBM and NCCL's achieved shares, each with its source). Model / published: published over "
        "modelled step time, the kernels alone, nothing fitted. In sample: with the framework overhead fitted to "
        f"every run in the fit ({fitted[0].in_sample:.2f}x the kernels' time); left out: fitted to the others "
        "only. Exposed comm: the share of the modelled step not computing.",
        f"The kernels alone land {len(within)} of {len(comparisons)} runs within 0.8-1.25x "
        f"({min(c.ratio(1.0) for c in comparisons):.2f}-{max(c.ratio(1.0) for c in comparisons):.2f}); "
        f"a fitted overhead, left out, gives {min(left_out):.2f}-{max(left_out):.2f} over the {len(fitted)} "
        "runs in the fit.",
    ]
    return "\n".join(rows) + "\n\n" + "\n".join(f"* {line}" for line in footer) + "\n"
