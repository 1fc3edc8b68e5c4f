"""The ``tsp`` section of a DeepSpeed JSON/hjson config (DESIGN.md section 7).

Everything here runs at start-up, before any process group or weight exists,
so a bad config fails in one place with a message naming ``tsp.<key>``.
"""

import copy
import json
import os
from typing import Literal

import hjson
from deepspeed.runtime.config_utils import DeepSpeedConfigModel, dict_raise_error_on_duplicate_keys
from pydantic import ConfigDict, Field, ValidationError, field_validator

# The architecture tables of ds_tsp.injection.policy.POLICIES (tests/test_policy.py keeps the two the same).
POLICY_NAMES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
                "gemma3_text", "gemma4_text", "olmo2", "olmoe", "flex_olmo", "minimax_m2", "olmo3")


class TSPConfigError(ValueError):
    """A ``tsp`` config value that cannot work; the message names the key and the fix."""


# What a valid value looks like, per key: pydantic's own messages do not know
# the JSON spelling (true/false) nor the domain meaning of each field.
_EXPECTED = {
    "enabled": "true or false",
    "size": "an integer >= 1 (the TSP group size D)",
    "expert_parallel_size": "an integer >= 1 (a multiple of tsp.size), or null for tsp.size",
    "pipeline_stages": "an integer >= 1",
    "layout": "one of \"zigzag\", \"contiguous\"",
    "attention_backend": "one of \"auto\", \"sdpa\", \"cudnn\", \"flash\"",
    "overlap": "true or false",
    "policy": "\"auto\" or one of " + ", ".join(f"\"{name}\"" for name in POLICY_NAMES),
    "timeout_minutes": "a finite number of minutes > 0",
    "vocab_parallel": "true or false",
    "logits_tile_mib": "a finite number of MiB > 0",
    "check_batch": "one of \"first\", \"always\", \"never\"",
    "token_tile": "an integer >= 0 (tokens; 0 turns tiling off)",
    "fp32_accumulators": "true or false",
    "recompute_norms": "true or false",
    "moe_schedule": "one of \"auto\", \"ring\", \"all_to_all\"",
    "latent_attention": "one of \"auto\", \"expanded\", \"absorbed\"",
    "prefetch_checkpoints": "true, false or \"auto\"",
}


def _json(value):
    return json.dumps(value, default=repr)


class TSPConfig(DeepSpeedConfigModel):
    """Selects and shapes tensor-sequence parallelism for a DeepSpeed job."""

    # Strict, because a JSON "4" or 2.5 for a group size is a typo to report,
    # not a value to coerce.
    model_config = ConfigDict(strict=True)

    enabled: bool = False
    """ Turn TSP on; when false the rest of the section is validated but unused. """

    size: int = Field(1, ge=1)
    """ TSP group size D: consecutive ranks that shard both sequence and weights. """

    pipeline_stages: int = Field(1, ge=1)
    """ Number of DeepSpeed pipeline stages, each made of TSP blocks. """

    expert_parallel_size: int | None = Field(None, ge=1)
    """ Ranks that split a mixture-of-experts layer's experts between them (E / expert_parallel_size each):
    consecutive ranks folding the TSP group and expert_parallel_size / tsp.size data-parallel replicas
    (DESIGN.md 6k). A multiple of tsp.size dividing tsp.size x the data-parallel size; null: tsp.size, the
    experts split over the TSP group alone. """

    layout: Literal["zigzag", "contiguous"] = "zigzag"
    """ How the sequence is split over the group; zigzag balances causal attention. """

    attention_backend: Literal["auto", "sdpa", "cudnn", "flash"] = "auto"
    """ Attention kernel; "auto" picks the fastest that passes a parity check where several serve (CUDA), else sdpa. """

    overlap: bool = True
    """ Prefetch the next weight shard while the current one computes. """

    policy: str = "auto"
    """ Architecture table to shard with: "auto" (detect from the model) or a name in ``POLICY_NAMES``. """

    timeout_minutes: float = Field(10.0, gt=0, allow_inf_nan=False)
    """ Timeout of TSP collectives, so a dead rank fails the job instead of hanging it. """

    vocab_parallel: bool = True
    """ Shard the embedding and LM head by vocabulary rows over the TSP group and fuse the head with the loss
    on a ring (no full logits); false keeps them replicated on every TSP rank. """

    logits_tile_mib: float = Field(32.0, gt=0, allow_inf_nan=False)
    """ Largest fp32 logits tile (local tokens x V/D) of the fused LM head and loss, in MiB. """

    token_tile: int = Field(8192, ge=0)
    """ Largest number of local tokens (over the micro-batch's rows) that a TSP layer's attention query block and
    MLP ring step process at once, which bounds the layer's working memory however long the sequence (a MoE
    expert's tokens too; the rows moe_schedule "all_to_all" exchanges, k per local token, are not tiled); 0
    processes all local tokens at once. Local tokens within one tile keep their attention's q, k, v and their
    MLP's and experts' gate and up projections for backward; in several tiles backward computes them again, a
    tile at a time. """

    fp32_accumulators: bool = True
    """ Sum the attention head groups, the MLP ring steps and the layer-input gradients in float32 for bf16/fp16
    models (one extra float32 copy of the local (S/D, H) activations); false sums in the model's dtype. """

    prefetch_checkpoints: bool | Literal["auto"] = "auto"
    """ With activation_checkpointing.cpu_checkpointing: start copying the layer below's checkpointed input back
    from host memory when a layer's backward starts, on a side stream (CUDA), so the copy runs under that
    layer's recompute and backward; costs one more layer input (B, S/D, H) on the device. "auto": where the
    planner (ds-tsp plan) puts the run's peak at the micro-batch's shape, with that one more input, within the
    device's memory (decided once per shape; never on CPU, where there is nothing to overlap). """

    moe_schedule: Literal["auto", "ring", "all_to_all"] = "auto"
    """ How a sparse mixture-of-experts layer meets its experts: "ring" moves the expert shards round the TSP group
    (bytes independent of the sequence), "all_to_all" keeps them at rest and sends each token to the ranks owning
    its top-k experts and back (bytes growing with the tokens); "auto" picks, per layer and micro-batch shape, the
    one the cost model says moves fewer bytes (ds-tsp plan reports both). The all-to-all keeps the rows it
    exchanged for backward, about 2 k H elements per local token and layer, where the ring keeps none of them: without
    activation checkpointing at long sequences, "ring" may fit where "auto" does not. Decoding uses neither:
    weights stay at rest and the ranks' shares are summed. """

    latent_attention: Literal["auto", "expanded", "absorbed"] = "auto"
    """ How a multi-head latent attention layer (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) attends to the gathered
    latent: "expanded" expands it into each head group's keys and values (query/key heads of qk_nope_head_dim +
    qk_rope_head_dim, values of v_head_dim), "absorbed" folds the key up-projection into the queries and attends
    in latent space (one shared key head of kv_lora_rank + qk_rope_head_dim), the value up-projection applied to
    the output. "auto" picks per layer and input shape the one the cost model counts fewer FLOPs for (for
    DeepSeek-V3: expanded wherever a rank holds 512 tokens or more of a 4K sequence or longer, absorbed for decoding
    and for short sequences over many ranks, where expanding every key for a few queries costs more); the choice is
    logged. Both give the same numbers. """

    recompute_norms: bool = False
    """ Keep only each RMSNorm's input for backward and run the norm again there, instead of its float32 copy of
    the input and its normalised values; the norm before the attention runs inside it, which keeps only the
    layer's input and norms it again a token tile (token_tile) at a time in backward. The numbers do not
    change. """

    check_batch: Literal["first", "always", "never"] = "always"
    """ When to check that every rank of a TSP group got the same micro-batch (a fingerprint of the batch's
    host copy, one all-gather of 16 int64 and one host synchronisation per forward: 0.9 ms, 0.2% of a step at
    2048 tokens on CPU ranks, benchmarks/batch_check.py; counted and planned as the comm op "batch_check"):
    on every forward, on the first only, or never. """

    def __init__(self, **data):
        # Checked before pydantic so that the message lists the known keys, and
        # so that a key named "strict" cannot reach the base class parameter.
        unknown = [key for key in data if key not in type(self).model_fields]
        if unknown:
            raise TSPConfigError("; ".join(f"tsp.{key} is not a known key; known keys: " +
                                           ", ".join(type(self).model_fields) for key in unknown))
        try:
            # strict=True stops the base class from silently dropping "auto" values.
            super().__init__(strict=True, **data)
        except ValidationError as err:
            raise TSPConfigError("\n".join(
                f"tsp.{'.'.join(map(str, e['loc']))} = {_json(e['input'])} is invalid: expected "
                f"{_EXPECTED.get(e['loc'][0], e['msg']) if e['loc'] else e['msg']}"
                for e in err.errors(include_url=False))) from None

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy):
        if policy != "auto" and policy not in POLICY_NAMES:
            raise ValueError("unknown policy")
        return policy

    def check_world(self, world_size: int) -> int:
        """Check that ``pp x tsp`` tiles ``world_size``; return the data-parallel size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be a positive integer, got {world_size!r}")
        model_ranks = self.size * self.pipeline_stages
        if world_size % model_ranks == 0:
            return world_size // model_ranks
        if world_size % self.pipeline_stages:
            fix = f"choose tsp.pipeline_stages from the divisors of {world_size}: {_divisors(world_size)}"
        else:
            per_stage = world_size // self.pipeline_stages
            fix = (f"with tsp.pipeline_stages = {self.pipeline_stages}, choose tsp.size from the "
                   f"divisors of {per_stage}: {_divisors(per_stage)}")
        raise TSPConfigError(f"tsp.size ({self.size}) x tsp.pipeline_stages ({self.pipeline_stages}) = "
                             f"{model_ranks} does not divide the world size {world_size}; {fix}")

    @property
    def folds_experts(self) -> bool:
        """Whether experts split over more ranks than the TSP group (``expert_parallel_size`` > ``size``)."""
        return self.expert_parallel_size not in (None, self.size)

    def expert_parallel(self, world_size: int) -> int:
        """Check ``expert_parallel_size`` against the mesh; return the expert-parallel size."""
        dp = self.check_world(world_size)
        ep = self.size if self.expert_parallel_size is None else self.expert_parallel_size
        if self.folds_experts and self.moe_schedule == "ring":
            raise TSPConfigError(f"tsp.moe_schedule = \"ring\" moves expert shards round the TSP group, but "
                                 f"tsp.expert_parallel_size = {ep} folds the experts over {ep // self.size} "
                                 "data-parallel replicas too, which only the token all-to-all reaches: set "
                                 "tsp.moe_schedule to \"all_to_all\" or \"auto\", or remove tsp.expert_parallel_size")
        if ep % self.size or (self.size * dp) % ep:
            choices = ", ".join(str(self.size * k) for k in range(1, dp + 1) if dp % k == 0)
            raise TSPConfigError(f"tsp.expert_parallel_size = {ep} must be a multiple of tsp.size ({self.size}) "
                                 f"dividing tsp.size x the data-parallel size ({self.size} x {dp}): choose one of "
                                 f"{choices}")
        return ep

    def check_experts(self, num_experts: int | None):
        """Check ``expert_parallel_size`` against a model's experts per layer
        (``num_experts``; None: a dense model, which takes none)."""
        if not self.folds_experts:
            return
        ep = self.expert_parallel_size
        if num_experts is None:
            raise TSPConfigError(f"tsp.expert_parallel_size = {ep} but the model has no mixture-of-experts layer: "
                                 "remove tsp.expert_parallel_size")
        if num_experts % ep:
            raise TSPConfigError(f"tsp.expert_parallel_size = {ep} does not divide the model's {num_experts} "
                                 f"experts per layer: choose a multiple of tsp.size ({self.size}) dividing "
                                 f"{num_experts}")


def _divisors(n):
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def load_ds_config(source) -> dict:
    """Return a DeepSpeed config as a fresh dict, from a dict or a JSON/hjson file path."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"DeepSpeed config must be a dict or a file path, got {type(source).__name__}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config file not found: {path}")
    with open(path, "r") as f:
        try:
            # Same reader as deepspeed.runtime.config: hjson accepts plain JSON
            # plus comments and trailing commas; the hook yields plain dicts.
            config = hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except ValueError as err:
            raise TSPConfigError(f"cannot parse DeepSpeed config {path}: {err}") from err
    if not isinstance(config, dict):
        raise TSPConfigError(f"DeepSpeed config {path} must hold a JSON object, got {_json(config)}")
    return config


def split_ds_config(ds_config) -> tuple[dict, TSPConfig]:
    """Return (the config without ``tsp``, for ``deepspeed.initialize``; the parsed ``tsp`` section)."""
    rest = load_ds_config(ds_config)
    section = rest.pop("tsp", {})
    if not isinstance(section, dict):
        raise TSPConfigError(f"tsp = {_json(section)} is invalid: expected a JSON object such as "
                             "{\"enabled\": true, \"size\": 2}")
    return rest, TSPConfig(**section)


def tsp_config_from(ds_config) -> TSPConfig:
    """Return the parsed ``tsp`` section of a whole DeepSpeed config (dict or path); defaults if absent."""
    return split_ds_config(ds_config)[1]
