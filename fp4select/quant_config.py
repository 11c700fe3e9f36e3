"""Which layers of a checkpoint are FP4: its quantization config, read.

``model_shapes`` asks ``quant_scheme(config, hf_quant)`` whether each dense GEMM it builds is
FP4; this module knows the quantization configs, that one the architectures.

Design rules:

* The quantization config decides which layers are FP4: ModelOpt's ``hf_quant_config.json``
  (``exclude_modules``, or ``quantized_layers`` for mixed precision), or ``quantization_config``
  in ``config.json`` (``ignore`` / ``exclude_modules`` / ``modules_to_not_convert``). Patterns
  are exact names, shell globs, or ``re:`` regular expressions; a pattern that names a parent
  module (``model.layers.*.self_attn``) covers its children. A config is input from the
  internet: ``re:`` patterns are matched without backtracking (fp4select.module_patterns:
  linear time, whatever the pattern), and every field is checked for its type before use, a
  wrong one being a ``ModelConfigError`` that names it. Without a quantization config
  every dense projection is assumed FP4, and the scheme's ``notes`` say so.
* A scheme that is not FP4 W4A4 (weight-only FP4, an unknown method) is a ``ModelConfigError``
  naming the field, never a guess: a wrong table tunes the wrong shapes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fp4select.module_patterns import MAX_PATTERN, PatternError, compile_pattern

__all__ = ["MODELOPT_QUANT_FILE", "ModelConfigError", "QuantScheme", "quant_scheme"]

MODELOPT_QUANT_FILE = "hf_quant_config.json"


class ModelConfigError(ValueError):
    """The config cannot be turned into shapes; the message names what is missing or wrong."""


@dataclass
class QuantScheme:
    format: str
    source: str
    exclude: list[str] = field(default_factory=list)
    only: dict[str, bool] | None = None  # mixed precision: name -> is FP4 (absent: not FP4)
    dense: bool = True  # False: the scheme makes no dense layer FP4 (gpt-oss's mxfp4)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._matchers = [_matcher(p, self.source) for p in self.exclude]

    def is_fp4(self, names: Sequence[str]) -> bool:
        """Whether the module known by any of ``names`` (spellings of one part) is FP4."""
        if not self.dense:
            return False
        if self.only is not None:
            return any(self.only.get(n, False) for n in names)
        return not any(_excluded(n, self._matchers) for n in names)


def _matcher(pattern: str, where: str) -> Callable[[str], bool]:
    """``pattern`` as a function of a module name (exact, glob, or ``re:``)."""
    if len(pattern) > MAX_PATTERN:
        raise ModelConfigError(
            f"{where}: a pattern is longer than {MAX_PATTERN} characters ({pattern[:40]!r}...)"
        )
    if pattern.startswith("re:"):
        try:
            return compile_pattern(pattern[3:])
        except PatternError as exc:
            raise ModelConfigError(f"{where}: pattern {pattern!r} is refused: {exc}") from None
    if any(c in pattern for c in "*?["):
        # fnmatch's translation has no nested quantifiers (each * is one lazy .*), and a
        # pattern is at most MAX_PATTERN characters.
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    return lambda name: name == pattern


def _excluded(name: str, matchers: Iterable[Callable[[str], bool]]) -> bool:
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(m(p) for m in matchers for p in prefixes)


_MAX_PATTERNS = 10000  # entries in one exclude list; real ones are at most a few hundred


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelConfigError(f"{where} must be a list of module names or patterns")
    if len(value) > _MAX_PATTERNS:
        raise ModelConfigError(f"{where} lists {len(value)} patterns (at most {_MAX_PATTERNS})")
    return list(value)


_FP4_ALGOS = {"NVFP4": "nvfp4", "MXFP4": "mxfp4", "W4A4_NVFP4": "nvfp4", "W4A4_MXFP4": "mxfp4"}


def _fp4_algo(algo: Any, where: str) -> str:
    if not isinstance(algo, str) or algo.upper() not in _FP4_ALGOS:
        raise ModelConfigError(
            f"{where} is {algo!r}: not an FP4 GEMM (W4A4) scheme ({', '.join(_FP4_ALGOS)}); "
            "a checkpoint without FP4 linear layers has nothing for fp4select to tune"
        )
    return _FP4_ALGOS[algo.upper()]


def _modelopt_quant(section: Mapping[str, Any], where: str) -> QuantScheme:
    algo = section.get("quant_algo")
    exclude = _strings(section.get("exclude_modules"), f"{where}.exclude_modules")
    exclude += _strings(section.get("ignore"), f"{where}.ignore")
    if isinstance(algo, str) and algo.upper() == "MIXED_PRECISION":
        layers = section.get("quantized_layers")
        if not isinstance(layers, dict):
            raise ModelConfigError(f"{where}: MIXED_PRECISION needs a quantized_layers object")
        only: dict[str, bool] = {}
        formats = set()
        if len(layers) > 1 << 20:
            raise ModelConfigError(f"{where}.quantized_layers lists {len(layers)} layers")
        for name, spec in layers.items():
            if not isinstance(spec, dict):
                raise ModelConfigError(f"{where}.quantized_layers[{name!r}] must be an object")
            a = spec.get("quant_algo")
            if isinstance(a, str) and a.upper() in _FP4_ALGOS:
                only[name] = True
                formats.add(_FP4_ALGOS[a.upper()])
        if len(formats) > 1:
            raise ModelConfigError(f"{where}: both NVFP4 and MXFP4 layers; give shapes by hand")
        return QuantScheme(formats.pop() if formats else "nvfp4", where, exclude, only=only)
    return QuantScheme(_fp4_algo(algo, f"{where}.quant_algo"), where, exclude)


def _compressed_tensors_quant(qc: Mapping[str, Any]) -> QuantScheme:
    where = "config.json quantization_config (compressed-tensors)"
    groups = qc.get("config_groups")
    fmt = qc.get("format", "")
    if not isinstance(fmt, str):
        raise ModelConfigError(f"{where}: format must be a string, got {fmt!r}")
    if groups is not None and not isinstance(groups, dict):
        raise ModelConfigError(f"{where}: config_groups must be an object")
    if groups:
        for name, group in groups.items():
            if not isinstance(group, dict):
                raise ModelConfigError(f"{where}: config_groups[{name!r}] must be an object")
            weights = group.get("weights") or {}
            acts = group.get("input_activations")
            if not isinstance(weights, dict):
                raise ModelConfigError(
                    f"{where}: config_groups[{name!r}].weights must be an object"
                )
            if weights.get("num_bits") != 4 or weights.get("type") != "float":
                raise ModelConfigError(f"{where}: group {name!r} is not FP4 weights")
            if not acts:
                raise ModelConfigError(
                    f"{where}: group {name!r} is FP4 weight-only (W4A16); those layers run in "
                    "W4A16 kernels (Marlin), not mm_fp4"
                )
            group_size = weights.get("group_size")
            fmt = "nvfp4" if group_size == 16 else "mxfp4" if group_size == 32 else fmt
    elif "nvfp4" not in fmt:
        raise ModelConfigError(f"{where}: format {fmt!r} is not an FP4 (W4A4) format")
    fmt = "mxfp4" if "mxfp4" in fmt else "nvfp4"
    return QuantScheme(fmt, where, _strings(qc.get("ignore"), f"{where}.ignore"))


def quant_scheme(config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None) -> QuantScheme:
    """Which dense layers of the model are FP4, from ``hf_quant_config.json`` (``hf_quant``,
    first) or ``config.json``'s ``quantization_config``; ``ModelConfigError`` if unreadable."""
    if hf_quant is not None:
        if not isinstance(hf_quant, Mapping):
            raise ModelConfigError(f"{MODELOPT_QUANT_FILE} must hold a JSON object")
        section = hf_quant.get("quantization")
        if not isinstance(section, dict):
            raise ModelConfigError(f"{MODELOPT_QUANT_FILE} has no 'quantization' object")
        return _modelopt_quant(section, f"{MODELOPT_QUANT_FILE} quantization")
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return QuantScheme(
            "nvfp4",
            "none",
            notes=[
                "no quantization config: every dense projection is assumed FP4 (NVFP4); "
                "give the checkpoint's hf_quant_config.json to use its exclude list"
            ],
        )
    if not isinstance(qc, dict):
        raise ModelConfigError("config.json quantization_config must be a JSON object")
    method = qc.get("quant_method", "")
    if not isinstance(method, str):
        raise ModelConfigError(
            f"config.json quantization_config.quant_method must be a string, got {method!r}"
        )
    method = method.lower()
    if method in ("modelopt", "modelopt_fp4"):
        return _modelopt_quant(qc, "config.json quantization_config")
    if method == "compressed-tensors":
        return _compressed_tensors_quant(qc)
    if method == "mxfp4":
        q = QuantScheme("mxfp4", "config.json quantization_config (mxfp4)", dense=False)
        q.notes.append(
            "quant_method mxfp4 (gpt-oss style) quantizes only the MoE experts; engines run the "
            "dense layers unquantized, so no dense layer is FP4"
        )
        return q
    raise ModelConfigError(
        f"config.json quantization_config has quant_method {method or None!r}: not a scheme "
        "fp4select knows to hold FP4 GEMMs (modelopt, compressed-tensors nvfp4, mxfp4)"
    )
