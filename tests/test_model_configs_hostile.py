"""Model configs are input from the internet: every bad field is one error naming it.

What broke before (issue 21): a ``re:([a-z_.0-9]+)+!`` exclude pattern hung, ``num_hidden_layers:
10**9`` allocated until MemoryError, bad fields gave raw tracebacks, ``head_dim`` 1.9 or true
became 1, and a FIFO named ``hf_quant_config.json`` was skipped without a word.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
import tracemalloc

import pytest
from test_model_shapes import (
    DEEPSEEK_V3,
    GPT_OSS_120B,
    LLAMA_31_8B,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    QWEN35_397B,
)

from fp4select.model_shapes import ModelConfigError, model_shapes, shapes_from_path
from fp4select.module_patterns import PatternError, compile_pattern

CONFIGS = {
    "llama": LLAMA_31_8B,
    "qwen3-moe": QWEN3_30B_A3B,
    "qwen3.5": QWEN35_397B,
    "deepseek-v3": DEEPSEEK_V3,
    "gpt-oss": GPT_OSS_120B,
    "mixtral": MIXTRAL_8X7B,
}
BAD_VALUES = [1.9, True, "8", -1, 0, 10**9, 10**30, [], {}, [1.5]]
MODELOPT = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}


def _fields(config):
    data = config.get("text_config", config)
    return [
        k for k, v in data.items() if k not in ("architectures", "model_type") and v is not None
    ]


def _with(config, field, value):
    changed = copy.deepcopy(config)
    changed.get("text_config", changed)[field] = value
    return changed


# Fields a family's rules never read (its shapes do not depend on them): any value passes.
UNUSED = {
    "qwen3-moe": {"intermediate_size", "moe_intermediate_size", "num_experts_per_tok"},
    "qwen3.5": {"linear_conv_kernel_dim", "num_experts_per_tok", "moe_intermediate_size"},
    "deepseek-v3": {"num_key_value_heads"},
    "gpt-oss": {"intermediate_size", "num_local_experts", "experts_per_token"},
    "mixtral": {"intermediate_size", "num_experts_per_tok"},
    "llama": set(),
}
# Values that are valid for some fields: 0 experts or layers of a kind, an empty list, a flag.
SANE = (0, [], True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_bad_field_is_an_error_naming_it_never_a_traceback(name):
    config = CONFIGS[name]
    for field in _fields(config):
        if field == "quantization_config":
            continue  # the hf_quant_config.json given takes precedence
        for value in BAD_VALUES:
            changed = _with(config, field, value)
            try:
                model_shapes(changed, MODELOPT, tp=1)
            except ModelConfigError as exc:
                if value != 0:  # 0 experts may make another field needed: that one is named
                    assert field in str(exc), (field, value, str(exc))
                continue
            assert field in UNUSED[name] or any(
                value is v or value == v for v in SANE if type(v) is type(value)
            ), (field, value)


@pytest.mark.parametrize("value", [1.9, True, "128", 0])
def test_head_dim_is_an_integer_or_an_error_naming_it(value):
    with pytest.raises(ModelConfigError, match="head_dim"):
        model_shapes(dict(LLAMA_31_8B, head_dim=value))


def test_a_billion_layers_is_refused_by_range_not_by_memory():
    with pytest.raises(ModelConfigError, match="num_hidden_layers must be between 1 and 4096"):
        model_shapes(dict(LLAMA_31_8B, num_hidden_layers=10**9))


def test_nothing_is_held_per_layer():
    """4096 layers (the most allowed) cost the memory of one: the table counts rows."""
    tracemalloc.start()
    try:
        model_shapes(dict(LLAMA_31_8B, num_hidden_layers=8))
        small = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        big = model_shapes(dict(LLAMA_31_8B, num_hidden_layers=4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert {layer.count for layer in big.layers} == {4096}
    assert peak < small + 64 * 1024, f"{peak - small} bytes more for 4096 layers than for 8"


def test_a_backtracking_pattern_is_matched_in_linear_time():
    """re.match would take exponential time on this pattern; the warm used to hang."""
    quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["re:([a-z_.0-9]+)+!"]}}
    done = threading.Event()
    result = {}

    def run():
        result["shapes"] = model_shapes(dict(LLAMA_31_8B, num_hidden_layers=4), quant)
        done.set()

    started = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "matching an exclude pattern hung"
    assert time.monotonic() - started < 30
    assert result["shapes"].layers  # nothing excluded: the pattern needs a "!"


@pytest.mark.parametrize(
    "pattern",
    [r"model\.layers\.\d+\.mlp.*", r"(?:a|b){2,5}$", r"[^a-c\w]x", r"^abc\Z", r"(ab|a)*c",
     r".*?lm_head", r"x?y*z+", r"(a*)*b", r"\w+\.\W", r"a{2,}", r"model\.layers\.(1|12)\.self_attn"],
)  # fmt: skip
def test_the_matcher_agrees_with_re_match(pattern):
    names = [
        "model.layers.1.mlp.gate", "model.layers.12.self_attn.q_proj", "abc", "aab", "ab", "a",
        "ababc", "xyyz", "lm_head", "a.b", "foo.-", "", "dx", "aaaa", "model.layers.12.self_attn",
    ]  # fmt: skip
    matches = compile_pattern(pattern)
    for name in names:
        assert matches(name) == (re.match(pattern, name) is not None), (pattern, name)


@pytest.mark.parametrize(
    "pattern, why",
    [(r"(a)\1", "GROUPREF"), (r"a(?=b)", "ASSERT"), (r"(?i)a", "inline flags"),
     ("a" * 2000, "longer than"), (r"(a{1000}){1000}", "states")],
)  # fmt: skip
def test_patterns_that_need_backtracking_are_refused_naming_the_pattern(pattern, why):
    with pytest.raises(PatternError, match=why):
        compile_pattern(pattern)
    quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["re:" + pattern]}}
    with pytest.raises(ModelConfigError, match=r"exclude_modules|pattern"):
        model_shapes(LLAMA_31_8B, quant)


@pytest.mark.parametrize(
    "quant, field",
    [
        ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}, "exclude_modules"),
        ({"quantization": {"quant_algo": 7}}, "quant_algo"),
        ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": 1}}},
         "quantized_layers"),
        ({"quantization": []}, "quantization"),
    ],
)  # fmt: skip
def test_bad_quantization_fields_are_named(quant, field):
    with pytest.raises(ModelConfigError, match=field):
        model_shapes(LLAMA_31_8B, quant)


@pytest.mark.parametrize(
    "qc, field",
    [
        ({"quant_method": 3}, "quant_method"),
        ({"quant_method": "compressed-tensors", "format": 5}, "format"),
        ({"quant_method": "compressed-tensors", "config_groups": []}, "config_groups"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": [4]}}},
         "weights"),
    ],
)  # fmt: skip
def test_bad_compressed_tensors_fields_are_named(qc, field):
    with pytest.raises(ModelConfigError, match=field):
        model_shapes(dict(LLAMA_31_8B, quantization_config=qc))


@pytest.mark.parametrize("which", ["hf_quant_config.json", "config.json"])
def test_a_fifo_is_refused_with_a_reason_never_skipped_or_waited_on(tmp_path, which):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT))
    (tmp_path / which).unlink()
    os.mkfifo(tmp_path / which)
    with pytest.raises(ModelConfigError, match=f"{which}: it is a FIFO, not a regular file"):
        shapes_from_path(tmp_path)
