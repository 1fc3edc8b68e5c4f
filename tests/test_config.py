"""The ``tsp`` config section: every bad value fails early, naming the key and the fix."""

import json

import pytest

from ds_tsp.config import (POLICY_NAMES, TSPConfig, TSPConfigError, load_ds_config, split_ds_config,
                           tsp_config_from)

# (tsp section, pattern the message must contain: the key, then the fix or the allowed values)
INVALID_SECTIONS = {
    "size_string": ({"size": "4"}, r"tsp\.size = \"4\".*integer >= 1"),
    "size_float": ({"size": 2.5}, r"tsp\.size = 2\.5.*integer >= 1"),
    "size_bool": ({"size": True}, r"tsp\.size = true.*integer >= 1"),
    "size_zero": ({"size": 0}, r"tsp\.size = 0.*integer >= 1"),
    "size_negative": ({"size": -2}, r"tsp\.size = -2.*integer >= 1"),
    "enabled_string": ({"enabled": "yes"}, r"tsp\.enabled = \"yes\".*true or false"),
    "enabled_int": ({"enabled": 1}, r"tsp\.enabled = 1.*true or false"),
    "overlap_string": ({"overlap": "true"}, r"tsp\.overlap = \"true\".*true or false"),
    "layout_int": ({"layout": 1}, r"tsp\.layout = 1.*\"zigzag\", \"contiguous\""),
    "layout_unknown": ({"layout": "ring"}, r"tsp\.layout = \"ring\".*\"zigzag\", \"contiguous\""),
    "pipeline_stages_zero": ({"pipeline_stages": 0}, r"tsp\.pipeline_stages = 0.*integer >= 1"),
    "backend_unknown": ({"attention_backend": "xformers"}, r"tsp\.attention_backend = \"xformers\".*\"sdpa\""),
    "policy_unknown": ({"policy": "gpt2"}, r"tsp\.policy = \"gpt2\".*\"auto\" or one of \"llama\", \"qwen2\""),
    "timeout_zero": ({"timeout_minutes": 0}, r"tsp\.timeout_minutes = 0.*> 0"),
    "timeout_string": ({"timeout_minutes": "10"}, r"tsp\.timeout_minutes = \"10\".*> 0"),
    "timeout_infinite": ({"timeout_minutes": float("inf")}, r"tsp\.timeout_minutes = Infinity.*finite"),
    "vocab_parallel_string": ({"vocab_parallel": "false"}, r"tsp\.vocab_parallel = \"false\".*true or false"),
    "logits_tile_zero": ({"logits_tile_mib": 0}, r"tsp\.logits_tile_mib = 0.*MiB > 0"),
    "logits_tile_nan": ({"logits_tile_mib": float("nan")}, r"tsp\.logits_tile_mib = NaN.*finite"),
    "token_tile_negative": ({"token_tile": -1}, r"tsp\.token_tile = -1.*integer >= 0"),
    "moe_schedule_unknown": ({"moe_schedule": "alltoall"},
                             r'tsp\.moe_schedule = "alltoall".*one of "auto", "ring", "all_to_all"'),
    "fp32_accumulators_string": ({"fp32_accumulators": "no"}, r"tsp\.fp32_accumulators = \"no\".*true or false"),
    "check_batch_unknown": ({"check_batch": "sometimes"}, r"tsp\.check_batch = \"sometimes\".*\"first\", \"always\""),
    "unknown_key": ({"sise": 2}, r"tsp\.sise is not a known key; known keys: enabled, size, pipeline_stages"),
    "base_class_param": ({"strict": False}, r"tsp\.strict is not a known key; known keys:"),
    "auto_size": ({"size": "auto"}, r"tsp\.size = \"auto\".*integer >= 1"),
    "tsp_not_object": ([2], r"tsp = \[2\] is invalid: expected a JSON object"),
    "tsp_is_true": (True, r"tsp = true is invalid: expected a JSON object"),
}


@pytest.mark.parametrize("section, match", INVALID_SECTIONS.values(), ids=INVALID_SECTIONS.keys())
def test_invalid_section_is_refused(section, match):
    with pytest.raises(TSPConfigError, match=match):
        tsp_config_from({"train_micro_batch_size_per_gpu": 1, "tsp": section})


def test_errors_are_not_raw_pydantic():
    with pytest.raises(TSPConfigError) as info:
        TSPConfig(size=0, layout="ring")
    assert "pydantic" not in str(info.value)
    assert info.value.__cause__ is None
    # One line per bad key, so both mistakes are reported in a single run.
    assert str(info.value).count("\n") == 1


@pytest.mark.parametrize(
    "section, world_size, match",
    [
        ({"size": 4}, 6, r"tsp\.size \(4\) x tsp\.pipeline_stages \(1\) = 4 does not divide the world size 6; "
         r".*choose tsp\.size from the divisors of 6: 1, 2, 3, 6"),
        ({"size": 2, "pipeline_stages": 2}, 6, r"= 4 does not divide the world size 6; "
         r"with tsp\.pipeline_stages = 2, choose tsp\.size from the divisors of 3: 1, 3"),
        ({"size": 1, "pipeline_stages": 3}, 4, r"choose tsp\.pipeline_stages from the divisors of 4: 1, 2, 4"),
    ],
)
def test_check_world_refuses_non_divisors(section, world_size, match):
    with pytest.raises(TSPConfigError, match=match):
        TSPConfig(**section).check_world(world_size)


@pytest.mark.parametrize("section, world_size, dp_size", [({}, 4, 4), ({"size": 2}, 4, 2),
                                                         ({"size": 2, "pipeline_stages": 2}, 8, 2),
                                                         ({"size": 4}, 4, 1)])
def test_check_world_returns_data_parallel_size(section, world_size, dp_size):
    assert TSPConfig(**section).check_world(world_size) == dp_size


def test_hjson_file_with_comments_and_trailing_commas(tmp_path):
    path = tmp_path / "ds_config.hjson"
    path.write_text("""{
      // the usual DeepSpeed keys
      "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2,},
      # the TSP section
      "tsp": {
        "enabled": true,
        "size": 4,
        "pipeline_stages": 2,
        "layout": "contiguous",
        "attention_backend": "sdpa",
        "overlap": false,
        "policy": "qwen2",
        "timeout_minutes": 5,
      },
    }
    """)
    rest, tsp = split_ds_config(path)
    assert rest == {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    assert type(rest["zero_optimization"]) is dict
    assert (tsp.enabled, tsp.size, tsp.pipeline_stages, tsp.layout, tsp.attention_backend, tsp.overlap,
            tsp.policy, tsp.timeout_minutes) == (True, 4, 2, "contiguous", "sdpa", False, "qwen2", 5.0)
    assert tsp.check_world(16) == 2


def test_json_file_path_as_string(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "tsp": {"enabled": True, "size": 2, "policy": "llama"}}))
    tsp = tsp_config_from(str(path))
    assert (tsp.enabled, tsp.size, tsp.policy) == (True, 2, "llama")
    assert load_ds_config(str(path)) == {"bf16": {"enabled": True}, "tsp": {"enabled": True, "size": 2,
                                                                            "policy": "llama"}}


def test_bad_key_in_file_names_the_key(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"tsp": {"size": 3, "layuot": "zigzag"}}')
    with pytest.raises(TSPConfigError, match=r"tsp\.layuot is not a known key; known keys: .*layout"):
        tsp_config_from(path)


def test_defaults_when_tsp_absent():
    tsp = tsp_config_from({"train_micro_batch_size_per_gpu": 1})
    assert tsp == TSPConfig()
    assert (tsp.enabled, tsp.size, tsp.pipeline_stages, tsp.layout, tsp.attention_backend, tsp.overlap,
            tsp.policy, tsp.timeout_minutes) == (False, 1, 1, "zigzag", "auto", True, "auto", 10.0)


@pytest.mark.parametrize("policy", ("auto", ) + POLICY_NAMES)
def test_every_named_policy_is_accepted(policy):
    assert TSPConfig(policy=policy).policy == policy


def test_split_removes_tsp_and_leaves_the_rest():
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                 "bf16": {"enabled": True}, "tsp": {"enabled": True, "size": 2}}
    original = json.loads(json.dumps(ds_config))
    rest, tsp = split_ds_config(ds_config)
    assert "tsp" not in rest
    assert rest == {k: v for k, v in original.items() if k != "tsp"}
    assert tsp.size == 2
    # The caller's dict is untouched and shares nothing with the returned one.
    assert ds_config == original
    rest["zero_optimization"]["stage"] = 3
    assert ds_config["zero_optimization"]["stage"] == 2


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "no_such_config.json"
    with pytest.raises(FileNotFoundError, match="no_such_config.json"):
        tsp_config_from(path)


def test_unparsable_file_names_the_path(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"tsp": {"size": }')
    with pytest.raises(TSPConfigError, match="broken.json"):
        load_ds_config(path)
