"""An optimizer built on the unsharded model, rebuilt over the TSP shards.

``deepspeed.initialize`` takes an optimizer instance or ``model_parameters``;
with TSP both refer to the Hugging Face parameters that injection replaces.
``ClientOptimizer`` keeps them by the Hugging Face names of their tensors and
rebuilds them over the shards: same class, defaults and parameter groups,
matched by name (``hf_tensors``), with weight decay kept off the biases and
norms that share a packed shard with decayed weights (``DecayMask``).
"""

import inspect
import math

import torch
import torch.distributed as dist

from ds_tsp.blocks.packing import PackedShardMixin
from ds_tsp.blocks.tower import ShardedUnit
from ds_tsp.injection.lora import LoRAAdapter, adapter_parameter_name, holds_adapters, peft_parameter_name


def hf_tensors(model):
    """``[(parameter, [(Hugging Face name, numel)])]`` of an injected model, each
    parameter once: a TSP block's packed shard holds its spec's tensors in
    order, each named by the Hugging Face tensor that holds its rows (Phi-3's
    q, k and v pieces all by ``qkv_proj.weight``: ``ds_tsp.blocks.fused``), a
    vision tower unit's slice the tensors it holds elements of, every
    other parameter (replicated in a block, a vocabulary shard, a norm) the
    one Hugging Face tensor of its own name; a LoRA adapter's factor is named
    by its projection (``lora.peft_parameter_name``)."""
    out = []
    for name, param in model.named_parameters():
        prefix, _, _ = name.rpartition(".")
        module = model.get_submodule(prefix)
        if isinstance(module, PackedShardMixin):
            if param is module.packed:
                out.append((param, [(f"{prefix}.{module.hf_rows.hf_name(n)}", math.prod(shape))
                                    for n, shape in module.spec.shapes.items()]))
                continue
            name = next((f"{prefix}.{hf}" for hf, p in module.replicated_params().items() if p is param), name)
        elif isinstance(module, ShardedUnit):  # this rank's slice of a tower unit's flat vector
            out.append((param, [(f"{prefix}.{hf}", numel) for hf, numel in module.held_pieces()]))
            continue
        elif isinstance(module, LoRAAdapter):
            name = adapter_parameter_name(model, prefix, name.rpartition(".")[2])
        out.append((param, [(name, param.numel())]))
    return out


class ClientOptimizer:
    """An optimizer instance or ``model_parameters`` over the unsharded model,
    kept by the Hugging Face names of its tensors and rebuilt over the shards.

    A packed shard whose tensors sit in groups that differ only in
    ``weight_decay`` (AdamW's groups put biases and norms without decay) joins
    the group without decay, and before every optimizer step the decay the
    other groups give is applied to its elements of theirs, on the tensor the
    optimizer updates (the parameter itself, or under ZeRO 1-2 and bf16 this
    rank's float32 fragment of it): the ``p *= 1 - lr * weight_decay`` AdamW
    applies before its update, element by element.
    """

    def __init__(self, optimizer, groups=None, grouped=False):
        self.optimizer = optimizer  # None, a callable, or an instance over the unsharded model
        self.groups = groups  # [(hyperparameters, [Hugging Face names])], or None: nothing to map
        self.grouped = grouped  # model_parameters came as groups (dicts)
        self.masks = []

    @classmethod
    def capture(cls, model, optimizer, model_parameters):
        """Record the client's groups by name; runs before injection."""
        instance = isinstance(optimizer, torch.optim.Optimizer)
        if not instance and model_parameters is None:
            return cls(optimizer)
        if not isinstance(model, torch.nn.Module):
            raise TypeError("an optimizer instance or model_parameters must hold the model's own parameters; with a "
                            "checkpoint path as model, pass the optimizer as a callable (e.g. optimizer=lambda "
                            "params: torch.optim.AdamW(params, lr=1e-3)) or in the config's \"optimizer\" section")
        if instance and optimizer.state:
            raise ValueError("the optimizer has already taken a step: its state belongs to the unsharded "
                             "parameters; build it afresh (or pass a callable) before ds_tsp.initialize")
        peft = holds_adapters(model)
        names = {id(param): peft_parameter_name(name) if peft else name for name, param in model.named_parameters()}
        source = list(optimizer.param_groups if instance else model_parameters)
        grouped = all(isinstance(entry, dict) for entry in source)
        groups = []
        for group in source if grouped else [{"params": source}]:
            params = list(group["params"])
            if any(id(p) not in names for p in params):
                raise ValueError("the optimizer or model_parameters hold tensors that are not parameters of the "
                                 "model passed to ds_tsp.initialize: build them from that model")
            groups.append(({k: v for k, v in group.items() if k != "params"}, [names[id(p)] for p in params]))
        return cls(optimizer, groups, grouped or instance)

    def rebuild(self, model, regroup=lambda groups: groups):
        """``(optimizer, model_parameters)`` for ``deepspeed.initialize`` over
        the injected ``model``'s parameters; ``regroup`` rearranges the
        parameter groups (``expert_parallel.expert_param_groups``)."""
        if self.groups is None:
            return self.optimizer, regroup([p for p in model.parameters() if p.requires_grad])
        group_of = {name: index for index, (_, names) in enumerate(self.groups) for name in names}
        # The tag finds a group again after load_state_dict, which replaces the group dicts.
        new_groups = [{**hyper, "params": [], DecayMask.TAG: index} for index, (hyper, _) in enumerate(self.groups)]
        for param, tensors in hf_tensors(model):
            names = sorted({name for name, _ in tensors})
            owners = [group_of.get(name) for name, _ in tensors]
            present = sorted({owner for owner in owners if owner is not None})
            if not present:
                continue
            if None in owners:
                raise ValueError(f"the optimizer holds only some of {names}, which TSP packs into one "
                                 "shard: give the optimizer all of them or none")
            host = present[0] if len(present) == 1 else self._decay_host(present, names)
            new_groups[host]["params"].append(param)
            if len(present) > 1:
                self.masks.append(DecayMask(param, [(numel, group_of[name]) for name, numel in tensors], host))
        if isinstance(self.optimizer, torch.optim.Optimizer):
            # Defaults the constructor takes; the others (AdamW's decoupled_weight_decay) ride in every group.
            accepted = inspect.signature(type(self.optimizer)).parameters
            defaults = {k: v for k, v in self.optimizer.defaults.items() if k in accepted and k != "params"}
            new_groups = regroup(new_groups)
            return type(self.optimizer)(new_groups, **defaults), new_groups
        return self.optimizer, regroup(new_groups if self.grouped else new_groups[0]["params"])

    def _decay_host(self, present, names):
        """The group a shard of tensors from several groups joins: the one
        without weight decay, when the groups differ in nothing else."""
        hypers = [self.groups[index][0] for index in present]
        others = [{k: v for k, v in hyper.items() if k != "weight_decay"} for hyper in hypers]
        hosts = [index for index, hyper in zip(present, hypers) if hyper.get("weight_decay", None) == 0]
        if any(other != others[0] for other in others) or not hosts:
            raise ValueError(f"TSP packs {names} into one shard, but the optimizer puts them in groups "
                             "that differ in more than weight_decay (or none has weight_decay 0); a shard trains "
                             "in one group: group them alike")
        return hosts[0]

    def attach(self, engine):
        """Apply the masks' decay before every step of the engine's optimizer."""
        if not self.masks:
            return
        inner = engine.basic_optimizer
        decoupled = isinstance(inner, torch.optim.AdamW) or inner.defaults.get("decoupled_weight_decay", False)
        if not decoupled:
            raise TypeError(f"{type(inner).__name__} couples weight decay to the gradient; a shard of tensors with "
                            "and without decay is supported with torch.optim.AdamW (decoupled decay): use it, or "
                            "give every tensor the same decay")
        # Read after the optimizer filled its defaults in; DeepSpeed drops groups left empty.
        built = {group[DecayMask.TAG]: group for group in inner.param_groups}
        decay = [float(built[index]["weight_decay"] if index in built else
                       hyper.get("weight_decay", inner.defaults.get("weight_decay", 0.0)))
                 for index, (hyper, _) in enumerate(self.groups)]
        for mask in self.masks:
            mask.resolve(decay, wrapped=engine.optimizer is not inner)
        inner.register_step_pre_hook(self._decay_before_step)

    def _decay_before_step(self, optimizer, args, kwargs):
        # ZeRO 1-2 step the optimizer one parameter group at a time, ZeRO-3 one sub-group of one.
        for group in optimizer.param_groups:
            for mask in self.masks:
                if mask.host == group.get(DecayMask.TAG):
                    mask.apply(group["lr"], group["params"])


class DecayMask:
    """The decay of one packed shard's pieces (``ClientOptimizer``): ``pieces``
    are ``(numel, client group index)`` in the shard's order, ``host`` the
    group the shard is optimised in."""

    TAG = "tsp_group"  # the client's group index, kept in each rebuilt group

    def __init__(self, param, pieces, host):
        self.param, self.pieces, self.host = param, pieces, host
        self.segments = []  # (start, end, weight_decay) of the pieces that decay

    def resolve(self, decay, wrapped):
        """Take the client groups' ``decay`` and check where the optimizer
        keeps this shard's values."""
        start = 0
        for numel, group in self.pieces:
            if decay[group]:
                self.segments.append((start, start + numel, decay[group]))
            start += numel
        if wrapped and not hasattr(self.param, "_hp_mapping") and not hasattr(self.param, "ds_id"):
            raise TypeError("this DeepSpeed optimizer (fp16 without ZeRO?) keeps no float32 fragment per parameter: "
                            "a shard of tensors with and without weight decay needs ZeRO in fp32 or bf16, or no "
                            "DeepSpeed optimizer wrapper")

    @torch.no_grad()
    def apply(self, lr, stepping):
        """Decay this shard's elements of the float32 values the optimizer is
        about to update (``stepping``: the tensors of the group it steps)."""
        if hasattr(self.param, "ds_id"):
            # ZeRO-3: this rank's partition of the float32 master, the ceil(numel / dp) elements from
            # its partition rank on, once: when the sub-group holding it steps.
            values = self.param._z3_optimizer.get_local_fp32_param(self.param)
            if values is None or not any(values.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                                         for p in stepping):
                return
            values = values.view(-1)
            offset = dist.get_rank(self.param.ds_process_group) * self.param.ds_tensor.ds_numel
        else:
            mapping = getattr(self.param, "_hp_mapping", False)
            if mapping is None:  # ZeRO 1-2: none of this shard is in this rank's partition
                return
            if mapping is False:  # no ZeRO, no wrapper: the optimizer updates the parameter itself
                values, offset = self.param.data.view(-1), 0
            else:  # this rank's float32 fragment, holding the shard's elements from ``offset`` on
                values, offset = mapping.get_hp_fragment().view(-1), mapping.lp_fragment_address.start
        for start, end, weight_decay in self.segments:
            lo, hi = max(start - offset, 0), min(end - offset, values.numel())
            if lo < hi:
                values[lo:hi].mul_(1 - lr * weight_decay)
