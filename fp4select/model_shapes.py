"""The dense FP4 GEMM shapes (N, K) one tensor-parallel rank of a model runs, from its config.

Why one file of ~620 lines: most of it is the per-family layer rules and their notes, and one
family's rules are checked against the others' (fused QKV, MLA, replicated KV heads); split,
the table would be read in pieces.

A deployment thinks in models and tensor-parallel degrees, not in (N, K); this module turns a
Hugging Face ``config.json`` (plus the checkpoint's quantization config) into the table of
linear layers that end in ``mm_fp4``, as the serving engines (vLLM, SGLang) build them.

Design rules:

* Shapes as engines run them: q/k/v are one fused QKV GEMM, gate/up one fused GEMM;
  column-parallel layers (QKV, gate_up, MLA's q_b/kv_b) split N by the TP degree, row-parallel
  layers (o_proj, down_proj, out_proj) split K; MLA's fused q_a/kv_a projection is replicated.
  KV heads fewer than the TP degree are replicated, one per rank, as vLLM and SGLang do.
* Only dense GEMMs. Routed MoE experts go through fused MoE kernels (not ``mm_fp4``), router
  gates (N = number of experts) are never FP4 in the engines, and ``lm_head``, embeddings,
  vision towers and speculative (MTP) layers are left out. Each exclusion is listed in
  ``notes`` so the table never silently drops a layer.
* Which layers are FP4 is the quantization config's to say: ``quant_config`` reads it (its
  rules are at its top). A fused GEMM whose parts disagree (q FP4, k not) is an error here:
  engines cannot fuse them.
* An architecture or a field it needs that is not known is a ``ModelConfigError`` naming what
  is missing, never a guess: a wrong table tunes the wrong shapes and gives a false sense of
  readiness.
* A config is input from the internet (``warm --model``, ``shapes_from_path``). Every field
  is read through ``_Cfg``, which checks its type and range (``head_dim: 1.9`` or ``true`` is
  an error, not 1) and names the field when it refuses; anything else a malformed config trips
  on is still one ``ModelConfigError``, never a traceback. Nothing is allocated per decoder
  layer (a builder gives layer i's GEMMs on demand), so ``num_hidden_layers: 10**9`` is
  refused by its range, not by a MemoryError. Only regular files are read: a FIFO named
  ``hf_quant_config.json`` is refused with a reason, never waited on, and never skipped (a
  skipped quantization config would tune every layer as FP4).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp4select.keys import MAX_DIM, Problem, shape_problems
from fp4select.quant_config import MODELOPT_QUANT_FILE, ModelConfigError, quant_scheme
from fp4select.store._jsonfile import decode, read_named_file

__all__ = [
    "KNOWN_ARCHITECTURES",
    "Layer",
    "ModelConfigError",
    "ModelShapes",
    "load_model_config",
    "model_shapes",
    "shapes_from_path",
]

CONFIG_FILE = "config.json"
_MAX_CONFIG_BYTES = 16 << 20  # config files are kilobytes; refuse to parse something huge
MAX_LAYERS = 4096  # decoder layers; the deepest published models have under 200
_MAX_HEADS = 1 << 16
_MAX_EXPERTS = 1 << 16


@dataclass(frozen=True)
class Layer:
    """One row of the table: a GEMM that ``count`` decoder layers run with this per-rank shape."""

    name: str  # the engine's (fused) module name inside a decoder layer, e.g. self_attn.qkv_proj
    n: int
    k: int
    count: int
    split: str  # "N" (column parallel), "K" (row parallel) or "none" (replicated)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {"layer": data.pop("name"), **data}


@dataclass
class ModelShapes:
    architecture: str
    tp: int
    format: str  # "nvfp4" or "mxfp4": the GEMM format of the FP4 layers
    layers: list[Layer]
    notes: list[str] = field(default_factory=list)
    quantization: str = "none"  # where the FP4 layer list came from

    def shapes(self) -> list[tuple[int, int]]:
        """Distinct (N, K) in table order: what ``warm`` tunes."""
        return list(dict.fromkeys((layer.n, layer.k) for layer in self.layers))

    def problems(self, max_m: int = 8192, **fields: Any) -> list[Problem]:
        """The problem keys to tune: every shape at every M bucket up to ``max_m``.

        ``fields`` are other Problem fields (out_dtype, a_sf_layout, b_layout, alpha_kind);
        the format and block size are the model's.
        """
        return shape_problems(self.shapes(), max_m, self.format, **fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "tp": self.tp,
            "format": self.format,
            "quantization": self.quantization,
            "layers": [layer.to_json() for layer in self.layers],
            "shapes": [list(s) for s in self.shapes()],
            "notes": list(self.notes),
        }


# -- reading ------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    """A regular file of at most ``_MAX_CONFIG_BYTES``, as a strict JSON object, read as the
    store reads a file the user named (links followed: Hugging Face caches link a snapshot's
    files to their blobs)."""
    try:
        obj, problem = decode(read_named_file(path, _MAX_CONFIG_BYTES))
    except OSError as exc:  # not a regular file (Damage), too large, unreadable
        raise ModelConfigError(f"cannot read {path}: {exc.strerror}") from None
    if obj is None:
        raise ModelConfigError(f"cannot read {path}: {problem}")
    return obj


def _exists(path: Path) -> bool:
    """Whether something (anything: a FIFO too) is at ``path``, its links followed."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise ModelConfigError(f"cannot read {path}: {exc.strerror}") from None
    return True


def load_model_config(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json or None) for a model folder or a config.json path;
    whatever is at either name must be a regular file (see the module's rules)."""
    p = Path(os.fsdecode(path))
    if p.is_dir():
        config_path = p / CONFIG_FILE
        if not _exists(config_path):
            raise ModelConfigError(f"{p} is a folder without {CONFIG_FILE}")
    elif _exists(p):
        config_path = p
    else:
        raise ModelConfigError(f"model path {p} does not exist")
    config = _read_json(config_path)
    quant_path = config_path.parent / MODELOPT_QUANT_FILE
    quant = _read_json(quant_path) if _exists(quant_path) else None
    return config, quant


def shapes_from_path(path: str | os.PathLike[str], tp: int = 1) -> ModelShapes:
    config, quant = load_model_config(path)
    return model_shapes(config, quant, tp=tp)


# -- the architectures --------------------------------------------------------------------------
class _Cfg:
    """Field access that checks each field's type and range and names it when it refuses."""

    def __init__(self, data: Mapping[str, Any], arch: str) -> None:
        self.data = data
        self.arch = arch

    def need(self, name: str, why: str = "") -> Any:
        value = self.data.get(name)
        if value is None:
            raise ModelConfigError(
                f"{self.arch}: config lacks {name!r}" + (f" (needed for {why})" if why else "")
            )
        return value

    def integer(
        self, name: str, why: str = "", default: int | None = None, lo: int = 1, hi: int = MAX_DIM
    ) -> int:
        """The int field ``name`` (``default`` when absent or null; required without one),
        between ``lo`` and ``hi``."""
        value = self.data.get(name)
        if value is None:
            if default is None:
                return self.need(name, why)  # raises
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelConfigError(f"{self.arch}: {name} must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ModelConfigError(
                f"{self.arch}: {name} must be between {lo} and {hi}, got {value!r}"
            )
        return value

    def optional_int(self, name: str, lo: int = 1, hi: int = MAX_DIM) -> int | None:
        """An int field that may be absent or null (then None)."""
        if self.data.get(name) is None:
            return None
        return self.integer(name, lo=lo, hi=hi)

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelConfigError(f"{self.arch}: {name} must be true or false, got {value!r}")
        return value

    def ints(self, name: str, hi: int) -> frozenset[int]:
        """A list of ints between 0 and ``hi`` (layer indices), as a set."""
        value = self.data.get(name)
        if value is None:
            return frozenset()
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi for v in value
        ):
            raise ModelConfigError(
                f"{self.arch}: {name} must be a list of layer indices (0 to {hi})"
            )
        return frozenset(value)

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ModelConfigError(f"{what} = {value} is not divisible by tp = {tp}")
    return value // tp


def _kv_heads_per_rank(kv: int, tp: int) -> int:
    """KV heads on one rank: split when tp divides them, else one replicated head per rank."""
    if kv >= tp:
        return _split(kv, tp, "num_key_value_heads")
    if tp % kv:
        raise ModelConfigError(f"tp = {tp} is neither a divisor nor a multiple of {kv} KV heads")
    return 1


@dataclass
class _Gemm:
    """One GEMM as engines run it; ``parts`` are the checkpoint modules fused into it (none
    given: the one module of its own name)."""

    name: str
    n: int
    k: int
    split: str
    parts: tuple[str | tuple[str, ...], ...] = ()  # a part may have several spellings

    def spellings(self) -> list[tuple[str, ...]]:
        return [p if isinstance(p, tuple) else (p,) for p in self.parts or (self.name,)]


class _Builder:
    """What an architecture's rules fill in: how many decoder layers, and the GEMMs of layer
    ``i`` on demand (``layer(i)``), so that nothing is held per layer."""

    def __init__(self, cfg: _Cfg, tp: int) -> None:
        self.cfg = cfg
        self.tp = tp
        self.count = 0
        self.layer: Callable[[int], list[_Gemm]] = lambda i: []
        self.notes: list[str] = []

    def layers(self, count: int, layer: Callable[[int], list[_Gemm]]) -> None:
        self.count = count
        self.layer = layer

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # Each helper returns the GEMMs of one block at this TP degree.
    def attention(self, hidden: int, heads: int, kv: int, head_dim: int, gate: bool = False):
        tp = self.tp
        q = _split(heads, tp, "num_attention_heads") * head_dim * (2 if gate else 1)
        kv_rank = _kv_heads_per_rank(kv, tp)
        parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        return [
            _Gemm("self_attn.qkv_proj", q + 2 * kv_rank * head_dim, hidden, "N", parts),
            _Gemm("self_attn.o_proj", hidden, heads // tp * head_dim, "K"),
        ]

    def mlp(self, hidden: int, inter: int, prefix: str = "mlp"):
        i = _split(inter, self.tp, f"{prefix} intermediate size")
        return [
            _Gemm(
                f"{prefix}.gate_up_proj",
                2 * i,
                hidden,
                "N",
                (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
            ),
            _Gemm(f"{prefix}.down_proj", hidden, i, "K"),
        ]

    def moe_layer_mlp(self, hidden: int, sparse: bool, shared: int) -> list[_Gemm]:
        """The MLP GEMMs of a layer: dense where it is not an MoE layer, else its shared expert
        (Qwen's; routed experts are not mm_fp4), else none."""
        if not sparse:
            return self.mlp(hidden, self.cfg.integer("intermediate_size", "the dense MLP layers"))
        if shared:
            self.note("the shared expert's gate (N = 1) is left out: not an FP4 GEMM")
            return self.mlp(hidden, shared, "mlp.shared_expert")
        return []

    def moe_notes(self) -> None:
        self.note(
            "routed MoE experts are left out: engines run them in fused MoE kernels, not mm_fp4"
        )
        self.note(
            "router gates (N = number of experts) are left out: engines keep them unquantized"
        )


def _hidden_heads(cfg: _Cfg) -> tuple[int, int, int, int]:
    hidden = cfg.integer("hidden_size", "every projection")
    heads = cfg.integer("num_attention_heads", "attention", hi=_MAX_HEADS)
    kv = cfg.integer("num_key_value_heads", "attention", default=heads, hi=_MAX_HEADS)
    head_dim = cfg.optional_int("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(
                f"{cfg.arch}: config lacks 'head_dim' and hidden_size {hidden} is not a "
                f"multiple of num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    return hidden, heads, kv, head_dim


def _layer_count(cfg: _Cfg) -> int:
    return cfg.integer("num_hidden_layers", "the layer count", hi=MAX_LAYERS)


def _dense_decoder(b: _Builder) -> None:
    """Llama, Mistral, Qwen2, Qwen3: attention + gated MLP in every layer."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    inter = cfg.integer("intermediate_size", "the MLP")
    gemms = b.attention(hidden, heads, kv, head_dim) + b.mlp(hidden, inter)
    b.layers(_layer_count(cfg), lambda i: gemms)


def _sparse_rule(cfg: _Cfg, experts: int, layers: int) -> Callable[[int], bool]:
    """Whether layer i is an MoE layer (Qwen2/3-MoE's decoder_sparse_step, mlp_only_layers)."""
    dense_only = cfg.ints("mlp_only_layers", hi=layers)
    step = cfg.integer("decoder_sparse_step", default=1, lo=0, hi=MAX_LAYERS) or 1
    return lambda i: experts > 0 and i not in dense_only and (i + 1) % step == 0


def _moe_decoder(b: _Builder) -> None:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: attention; MoE (with a shared expert if any) or dense MLP."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    name = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    if cfg.get(name) is None:
        cfg.need("num_experts", "the MoE layers")
    experts = cfg.integer(name, lo=0, hi=_MAX_EXPERTS)
    shared = cfg.integer("shared_expert_intermediate_size", default=0, lo=0)
    layers = _layer_count(cfg)
    sparse = _sparse_rule(cfg, experts, layers)
    attention = b.attention(hidden, heads, kv, head_dim)
    b.moe_notes()
    b.layers(layers, lambda i: attention + b.moe_layer_mlp(hidden, sparse(i), shared))


def _hybrid_decoder(b: _Builder) -> None:
    """Qwen3-Next, Qwen3.5: Gated DeltaNet (linear attention) layers with periodic full attention.

    Full attention has an output gate (q_proj doubles). The linear-attention GEMMs are
    in_proj_qkvz (N = 2 key dims + 2 value dims), in_proj_ba (N = 2 x value heads) and out_proj,
    as vLLM and SGLang fuse them (Qwen3.5's checkpoint splits qkv/z and b/a; the engines merge
    them back).
    """
    cfg = b.cfg
    tp = b.tp
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    layers = _layer_count(cfg)
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.integer(
            "full_attention_interval", "which layers are full attention", hi=MAX_LAYERS
        )

        def full(i: int) -> bool:
            return (i + 1) % interval == 0

    elif (
        not isinstance(types, list)
        or len(types) != layers
        or not all(t in ("full_attention", "linear_attention") for t in types)
    ):
        raise ModelConfigError(
            f"{cfg.arch}: layer_types must list full_attention/linear_attention for each of "
            f"{layers} layers"
        )
    else:

        def full(i: int) -> bool:
            return bool(types[i] == "full_attention")

    k_heads = cfg.integer("linear_num_key_heads", "linear attention", hi=_MAX_HEADS)
    k_heads = _split(k_heads, tp, "linear key heads")
    v_heads = cfg.integer("linear_num_value_heads", "linear attention", hi=_MAX_HEADS)
    v_heads = _split(v_heads, tp, "linear value heads")
    k_dim = k_heads * cfg.integer("linear_key_head_dim", "linear attention")
    v_dim = v_heads * cfg.integer("linear_value_head_dim", "linear attention")
    linear = [
        _Gemm(
            "linear_attn.in_proj_qkvz",
            2 * k_dim + 2 * v_dim,
            hidden,
            "N",
            (
                ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_qkv"),
                ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_z"),
            ),
        ),
        _Gemm(
            "linear_attn.in_proj_ba",
            2 * v_heads,
            hidden,
            "N",
            (
                ("linear_attn.in_proj_ba", "linear_attn.in_proj_b"),
                ("linear_attn.in_proj_ba", "linear_attn.in_proj_a"),
            ),
        ),
        _Gemm("linear_attn.out_proj", hidden, v_dim, "K"),
    ]
    experts = cfg.integer("num_experts", default=0, lo=0, hi=_MAX_EXPERTS)
    shared = cfg.integer("shared_expert_intermediate_size", default=0, lo=0)
    if experts:
        b.moe_notes()
    gate = cfg.flag("attn_output_gate", True)
    attention = b.attention(hidden, heads, kv, head_dim, gate=gate)
    sparse = _sparse_rule(cfg, experts, layers)

    def layer(i: int) -> list[_Gemm]:
        mixer = attention if full(i) else linear
        return mixer + b.moe_layer_mlp(hidden, sparse(i), shared)

    b.layers(layers, layer)
    b.note("the checkpoint's parts (in_proj_qkv + in_proj_z, in_proj_b + in_proj_a) are fused")


def _mla_decoder(b: _Builder) -> None:
    """DeepSeek-V2/V3: multi-head latent attention, dense MLP layers, shared experts."""
    cfg = b.cfg
    tp = b.tp
    hidden = cfg.integer("hidden_size", "every projection")
    heads = cfg.integer("num_attention_heads", "attention", hi=_MAX_HEADS)
    heads = _split(heads, tp, "num_attention_heads")
    q_lora = cfg.optional_int("q_lora_rank", lo=0)
    kv_lora = cfg.integer("kv_lora_rank", "MLA")
    nope = cfg.integer("qk_nope_head_dim", "MLA")
    rope = cfg.integer("qk_rope_head_dim", "MLA")
    v_dim = cfg.integer("v_head_dim", "MLA")
    if q_lora:
        attn = [
            _Gemm(
                "self_attn.fused_qkv_a_proj_with_mqa",
                q_lora + kv_lora + rope,
                hidden,
                "none",
                ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
            ),
            _Gemm("self_attn.q_b_proj", heads * (nope + rope), q_lora, "N"),
        ]
    else:
        attn = [
            _Gemm("self_attn.q_proj", heads * (nope + rope), hidden, "N"),
            _Gemm("self_attn.kv_a_proj_with_mqa", kv_lora + rope, hidden, "none"),
        ]
    attn += [
        _Gemm("self_attn.kv_b_proj", heads * (nope + v_dim), kv_lora, "N"),
        _Gemm("self_attn.o_proj", hidden, heads * v_dim, "K"),
    ]
    b.note(
        "MLA: kv_b_proj is included as engines run it in prefill; decode absorbs it into "
        "batched matmuls that are not mm_fp4"
    )
    first_dense = cfg.integer("first_k_dense_replace", default=0, lo=0, hi=MAX_LAYERS)
    freq = cfg.integer("moe_layer_freq", default=1, lo=0, hi=MAX_LAYERS) or 1
    routed = cfg.integer("n_routed_experts", default=0, lo=0, hi=_MAX_EXPERTS)
    n_shared = cfg.integer("n_shared_experts", default=0, lo=0, hi=_MAX_EXPERTS)
    if routed:
        b.moe_notes()

    def layer(i: int) -> list[_Gemm]:
        if routed and i >= first_dense and i % freq == 0:
            if not n_shared:
                return attn
            moe_inter = cfg.integer("moe_intermediate_size", "the shared experts")
            return attn + b.mlp(hidden, moe_inter * n_shared, "mlp.shared_experts")
        return attn + b.mlp(hidden, cfg.integer("intermediate_size", "the dense MLP layers"))

    b.layers(_layer_count(cfg), layer)
    if cfg.integer("num_nextn_predict_layers", default=0, lo=0, hi=MAX_LAYERS):
        b.note("MTP (next-n prediction) layers are left out: they serve speculative decoding")


def _gpt_oss(b: _Builder) -> None:
    """gpt-oss: attention (with sinks) in every layer, MoE MLP in every layer."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    b.moe_notes()
    attention = b.attention(hidden, heads, kv, head_dim)
    b.layers(_layer_count(cfg), lambda i: attention)


_ARCHITECTURES: dict[str, Callable[[_Builder], None]] = {
    "LlamaForCausalLM": _dense_decoder,
    "MistralForCausalLM": _dense_decoder,
    "Qwen2ForCausalLM": _dense_decoder,
    "Qwen3ForCausalLM": _dense_decoder,
    "MixtralForCausalLM": _moe_decoder,
    "Qwen2MoeForCausalLM": _moe_decoder,
    "Qwen3MoeForCausalLM": _moe_decoder,
    "Qwen3NextForCausalLM": _hybrid_decoder,
    "Qwen3_5ForCausalLM": _hybrid_decoder,
    "Qwen3_5ForConditionalGeneration": _hybrid_decoder,
    "Qwen3_5MoeForCausalLM": _hybrid_decoder,
    "Qwen3_5MoeForConditionalGeneration": _hybrid_decoder,
    "DeepseekV2ForCausalLM": _mla_decoder,
    "DeepseekV3ForCausalLM": _mla_decoder,
    "GptOssForCausalLM": _gpt_oss,
}
KNOWN_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_ARCHITECTURES))


def model_shapes(
    config: Mapping[str, Any], hf_quant: Mapping[str, Any] | None = None, tp: int = 1
) -> ModelShapes:
    """The per-rank FP4 GEMM table of a model: ``config`` is config.json as a dict.

    ``hf_quant`` is ModelOpt's hf_quant_config.json when the checkpoint has one. Raises
    ``ModelConfigError`` naming what is missing for an unknown architecture or field.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ModelConfigError(f"tp must be a positive int, got {tp!r}")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelConfigError(
            "config.json has no 'architectures' list, so the model family is unknown; "
            "give shapes with --shape N,K"
        )
    arch = archs[0]
    build = _ARCHITECTURES.get(arch)
    if build is None:
        raise ModelConfigError(
            f"architecture {arch!r} is not known to fp4select (known: "
            f"{', '.join(KNOWN_ARCHITECTURES)}); give its shapes with --shape N,K"
        )
    nested = isinstance(config.get("text_config"), dict)
    data = config["text_config"] if nested else config
    try:
        return _table(arch, build, config, data, hf_quant, tp, nested)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError) as exc:
        # every field is checked where it is read; this is the net under that rule
        raise ModelConfigError(
            f"{arch}: the config is malformed ({type(exc).__name__}: {exc})"
        ) from None


def _table(
    arch: str,
    build: Callable[[_Builder], None],
    config: Mapping[str, Any],
    data: Mapping[str, Any],
    hf_quant: Mapping[str, Any] | None,
    tp: int,
    nested: bool,
) -> ModelShapes:
    quant = quant_scheme(config, hf_quant)
    builder = _Builder(_Cfg(data, arch), tp)
    build(builder)
    prefixes = (
        ("model.language_model.layers", "model.layers", "language_model.model.layers")
        if nested
        else ("model.layers",)
    )
    rows: dict[tuple[str, int, int, str], int] = {}
    left_out: dict[str, int] = {}
    for i in range(builder.count):
        for g in builder.layer(i):
            flags = [
                quant.is_fp4([f"{prefix}.{i}.{name}" for prefix in prefixes for name in names])
                for names in g.spellings()
            ]
            fp4 = all(flags)
            if any(flags) and not fp4:
                raise ModelConfigError(
                    f"layer {i} {g.name}: the quantization config makes some of its parts FP4 "
                    f"and others not ({', '.join('/'.join(n) for n in g.spellings())}); "
                    "engines fuse them into one GEMM, so they must agree"
                )
            if not fp4:
                left_out[g.name] = left_out.get(g.name, 0) + 1
                continue
            if g.n < 1 or g.k < 1:
                raise ModelConfigError(f"{g.name} has an empty shape N={g.n} K={g.k} at tp={tp}")
            row = (g.name, g.n, g.k, g.split)
            rows[row] = rows.get(row, 0) + 1
    notes = list(quant.notes) + builder.notes
    for name, count in left_out.items():
        notes.append(f"{name}: {count} layer(s) not FP4 per {quant.source}")
    if nested:
        notes.append("text decoder only: the vision tower is left out")
    notes.append("lm_head and embeddings are left out: engines keep them unquantized")
    layers = [Layer(name, n, k, count, split) for (name, n, k, split), count in rows.items()]
    return ModelShapes(arch, tp, quant.format, layers, notes, quant.source)
