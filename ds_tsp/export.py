"""``ds-tsp export``: a DeepSpeed checkpoint of a TSP model -> a Hugging Face directory.

DeepSpeed writes one ``mp_rank_XX_model_states.pt`` per TSP rank (the TSP group
is DeepSpeed's model-parallel group), each holding that rank's packed shards,
its rows of the embedding and LM head when the vocabulary is folded, and the
replicated tensors. This joins them in one process, without
torch.distributed, into ``config.json`` + ``model.safetensors`` that
``AutoModelForCausalLM.from_pretrained`` loads.
"""

import os
import re

import torch
from tqdm.auto import tqdm

from .checkpoint import (CheckpointError, _prepare_out_dir, join_holdings, layer_shards, meta_model, untied,
                         vocab_names, write_hf_checkpoint)
from .policy import resolve_policy

# Replicated tensors of a TSP block: Hugging Face name -> parameter name.
_BLOCK_REPLICATED = {"o_proj.bias": "o_bias", "down_proj.bias": "down_bias", "q_norm.weight": "q_norm.weight",
                     "k_norm.weight": "k_norm.weight"}
_MODEL_STATES = re.compile(r"mp_rank_(\d+)_model_states\.pt")


def read_rank_states(checkpoint_dir, tag=None):
    """The ``module`` state dict of every TSP rank, in rank order."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"{checkpoint_dir} has no 'latest' file: pass --tag")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(checkpoint_dir, tag)
    files = sorted((int(m.group(1)), name) for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if (m := _MODEL_STATES.fullmatch(name)))
    if not files or [rank for rank, _ in files] != list(range(len(files))):
        raise CheckpointError(f"{folder} has no complete set of mp_rank_XX_model_states.pt files")
    # DeepSpeed's files hold non-tensor state (config, counters) as well.
    return [torch.load(os.path.join(folder, name), map_location="cpu", weights_only=False)["module"]
            for _, name in files]


def join_vocab(name, per_rank, vocab_size):
    """The full ``(V, H)`` matrix from every rank's copy: whole when replicated,
    else the ranks' rows in order with the padding rows dropped."""
    if per_rank[0].shape[0] == vocab_size:
        return per_rank[0]
    full = torch.cat(per_rank)
    if full.shape[0] < vocab_size:
        raise CheckpointError(f"the ranks' rows of {name} ({full.shape[0]}) do not cover vocab_size {vocab_size}")
    return full[:vocab_size]


def export_deepspeed_checkpoint(checkpoint_dir, model_dir, out_dir, tag=None, force=False):
    """Join the TSP ranks' shards of a DeepSpeed checkpoint into a Hugging Face
    directory; ``model_dir`` supplies the model's config (the original HF dir).
    ZeRO-3 checkpoints keep parameters in the optimizer files: not supported."""
    model, _ = meta_model(model_dir)
    policy = resolve_policy(model, "auto")
    states = read_rank_states(os.fspath(checkpoint_dir), tag)
    tsp_size = len(states)
    full = {}
    for index, layer in enumerate(tqdm(model.get_submodule(policy.layers), desc=f"Joining {tsp_size} TSP ranks",
                                       unit="layer")):
        prefix = f"{policy.layers}.{index}"
        for block, (specs, holdings) in layer_shards(layer, model.config, policy, tsp_size).items():
            named = []
            for spec, state in zip(specs, states):
                tensors = spec.unpack(state[f"{prefix}.{block}.packed"])
                tensors.update({hf: state[f"{prefix}.{block}.{param}"] for hf, param in _BLOCK_REPLICATED.items()
                                if f"{prefix}.{block}.{param}" in state})
                named.append(tensors)
            for name in holdings[0].keys() | {n for held in holdings for n in held}:
                full[f"{prefix}.{block}.{name}"] = join_holdings(
                    name, [(held[name], tensors[name]) for held, tensors in zip(holdings, named) if name in held])
    block_prefixes = tuple(f"{policy.layers}.{i}.{b}." for i in range(len(model.get_submodule(policy.layers)))
                           for b in (policy.attention, policy.mlp))
    full.update({name: tensor for name, tensor in states[0].items() if not name.startswith(block_prefixes)})
    full.update({name: join_vocab(name, [state[name] for state in states], model.config.vocab_size)
                 for name in vocab_names(model, policy) if name in states[0]})
    expected = set(untied(model, dict(model.state_dict())))
    state = {name: full[name] for name in expected if name in full}
    missing = expected - set(state)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {sorted(missing)[:5]}: was it written from this model?")
    # Copies the model directory's other files (tokenizer, generation config).
    _prepare_out_dir(os.fspath(model_dir), os.fspath(out_dir), force)
    write_hf_checkpoint(os.fspath(out_dir), state, model.config, getattr(model, "generation_config", None))
