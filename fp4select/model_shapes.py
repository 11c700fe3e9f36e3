"""The dense FP4 GEMM shapes (N, K) one tensor-parallel rank of a model runs, from its config.

Why one file of ~550 lines: most of it is the per-family layer rules and their notes, and one
family's rules are checked against the others' (fused QKV, MLA, replicated KV heads); split,
the table would be read in pieces. Reading the quantization config is ``quant_config``'s job.

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
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4select.keys import M_BUCKETS, Problem, m_bucket
from fp4select.quant_config import MODELOPT_QUANT_FILE, ModelConfigError, quant_scheme

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


@dataclass(frozen=True)
class Layer:
    """One row of the table: a GEMM that ``count`` decoder layers run with this per-rank shape."""

    name: str  # the engine's (fused) module name inside a decoder layer, e.g. self_attn.qkv_proj
    n: int
    k: int
    count: int
    split: str  # "N" (column parallel), "K" (row parallel) or "none" (replicated)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.name,
            "n": self.n,
            "k": self.k,
            "count": self.count,
            "split": self.split,
        }


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
        seen: dict[tuple[int, int], None] = {}
        for layer in self.layers:
            seen.setdefault((layer.n, layer.k), None)
        return list(seen)

    def problems(self, max_m: int = 8192, **fields: Any) -> list[Problem]:
        """The problem keys to tune: every shape at every M bucket up to ``max_m``.

        ``fields`` are other Problem fields (out_dtype, a_sf_layout, b_layout, alpha_kind);
        the format and block size are the model's.
        """
        nvfp4 = self.format == "nvfp4"
        top = m_bucket(max_m)
        return [
            Problem(n=n, k=k, m_bucket=b, use_nvfp4=nvfp4, block_size=16 if nvfp4 else 32, **fields)
            for n, k in self.shapes()
            for b in M_BUCKETS
            if b <= top
        ]

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
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path} is {size} bytes; a model config is far smaller")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def load_model_config(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json or None) for a model folder or a config.json path."""
    p = Path(os.fsdecode(path))
    if p.is_dir():
        config_path = p / CONFIG_FILE
        if not config_path.is_file():
            raise ModelConfigError(f"{p} is a folder without {CONFIG_FILE}")
    elif p.is_file():
        config_path = p
    else:
        raise ModelConfigError(f"model path {p} does not exist")
    config = _read_json(config_path)
    quant_path = config_path.parent / MODELOPT_QUANT_FILE
    quant = _read_json(quant_path) if quant_path.is_file() else None
    return config, quant


def shapes_from_path(path: str | os.PathLike[str], tp: int = 1) -> ModelShapes:
    config, quant = load_model_config(path)
    return model_shapes(config, quant, tp=tp)


# -- the architectures --------------------------------------------------------------------------
class _Cfg:
    """Field access that names the architecture and the field when one is missing."""

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

    def int(self, name: str, why: str = "", default: int | None = None) -> int:
        value = self.data.get(name, default)
        if value is None:
            return self.need(name, why)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ModelConfigError(f"{self.arch}: {name} must be a non-negative int, got {value!r}")
        return value

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
    """One GEMM as engines run it; ``parts`` are the checkpoint modules fused into it."""

    name: str
    parts: tuple[str | tuple[str, ...], ...]  # a part may have several spellings
    n: int
    k: int
    split: str

    def spellings(self) -> list[tuple[str, ...]]:
        return [p if isinstance(p, tuple) else (p,) for p in self.parts]


class _Builder:
    def __init__(self, cfg: _Cfg, tp: int) -> None:
        self.cfg = cfg
        self.tp = tp
        self.per_layer: list[list[_Gemm]] = []
        self.notes: list[str] = []

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
            _Gemm("self_attn.qkv_proj", parts, q + 2 * kv_rank * head_dim, hidden, "N"),
            _Gemm("self_attn.o_proj", ("self_attn.o_proj",), hidden, heads // tp * head_dim, "K"),
        ]

    def mlp(self, hidden: int, inter: int, prefix: str = "mlp"):
        i = _split(inter, self.tp, f"{prefix} intermediate size")
        return [
            _Gemm(
                f"{prefix}.gate_up_proj",
                (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
                2 * i,
                hidden,
                "N",
            ),
            _Gemm(f"{prefix}.down_proj", (f"{prefix}.down_proj",), hidden, i, "K"),
        ]

    def moe_notes(self) -> None:
        self.note(
            "routed MoE experts are left out: engines run them in fused MoE kernels, not mm_fp4"
        )
        self.note(
            "router gates (N = number of experts) are left out: engines keep them unquantized"
        )


def _hidden_heads(cfg: _Cfg) -> tuple[int, int, int, int]:
    hidden = cfg.int("hidden_size", "every projection")
    heads = cfg.int("num_attention_heads", "attention")
    kv = cfg.int("num_key_value_heads", "attention", default=heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if heads == 0 or hidden % heads:
            raise ModelConfigError(
                f"{cfg.arch}: config lacks 'head_dim' and hidden_size {hidden} is not a "
                f"multiple of num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    return hidden, heads, kv, int(head_dim)


def _dense_decoder(b: _Builder) -> None:
    """Llama, Mistral, Qwen2, Qwen3: attention + gated MLP in every layer."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    inter = cfg.int("intermediate_size", "the MLP")
    for _ in range(cfg.int("num_hidden_layers", "the layer count")):
        b.per_layer.append(b.attention(hidden, heads, kv, head_dim) + b.mlp(hidden, inter))


def _is_sparse(cfg: _Cfg, i: int, experts: int) -> bool:
    if experts <= 0 or i in (cfg.get("mlp_only_layers") or []):
        return False
    step = cfg.int("decoder_sparse_step", default=1) or 1
    return (i + 1) % step == 0


def _moe_decoder(b: _Builder) -> None:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: attention; MoE (with a shared expert if any) or dense MLP."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        cfg.need("num_experts", "the MoE layers")
    shared = cfg.int("shared_expert_intermediate_size", default=0)
    b.moe_notes()
    for i in range(cfg.int("num_hidden_layers", "the layer count")):
        gemms = b.attention(hidden, heads, kv, head_dim)
        if _is_sparse(cfg, i, int(experts)):
            if shared:
                gemms += b.mlp(hidden, shared, "mlp.shared_expert")
                b.note("the shared expert's gate (N = 1) is left out: not an FP4 GEMM")
        else:
            gemms += b.mlp(hidden, cfg.int("intermediate_size", "the dense MLP layers"))
        b.per_layer.append(gemms)


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
    layers = cfg.int("num_hidden_layers", "the layer count")
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.int("full_attention_interval", "which layers are full attention")
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
        raise ModelConfigError(
            f"{cfg.arch}: layer_types must list full_attention/linear_attention for each of "
            f"{layers} layers"
        )
    k_heads = _split(cfg.int("linear_num_key_heads", "linear attention"), tp, "linear key heads")
    v_heads = _split(
        cfg.int("linear_num_value_heads", "linear attention"), tp, "linear value heads"
    )
    k_dim = k_heads * cfg.int("linear_key_head_dim", "linear attention")
    v_dim = v_heads * cfg.int("linear_value_head_dim", "linear attention")
    linear = [
        _Gemm(
            "linear_attn.in_proj_qkvz",
            (
                ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_qkv"),
                ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_z"),
            ),
            2 * k_dim + 2 * v_dim,
            hidden,
            "N",
        ),
        _Gemm(
            "linear_attn.in_proj_ba",
            (
                ("linear_attn.in_proj_ba", "linear_attn.in_proj_b"),
                ("linear_attn.in_proj_ba", "linear_attn.in_proj_a"),
            ),
            2 * v_heads,
            hidden,
            "N",
        ),
        _Gemm("linear_attn.out_proj", ("linear_attn.out_proj",), hidden, v_dim, "K"),
    ]
    experts = int(cfg.get("num_experts", 0))
    shared = cfg.int("shared_expert_intermediate_size", default=0)
    if experts:
        b.moe_notes()
    gate = bool(cfg.get("attn_output_gate", True))
    for i, kind in enumerate(types):
        if kind == "full_attention":
            gemms = b.attention(hidden, heads, kv, head_dim, gate=gate)
        else:
            gemms = list(linear)
        if _is_sparse(cfg, i, experts):
            if shared:
                gemms += b.mlp(hidden, shared, "mlp.shared_expert")
                b.note("the shared expert's gate (N = 1) is left out: not an FP4 GEMM")
        else:
            gemms += b.mlp(hidden, cfg.int("intermediate_size", "the dense MLP"))
        b.per_layer.append(gemms)
    b.note("the checkpoint's parts (in_proj_qkv + in_proj_z, in_proj_b + in_proj_a) are fused")


def _mla_decoder(b: _Builder) -> None:
    """DeepSeek-V2/V3: multi-head latent attention, dense MLP layers, shared experts."""
    cfg = b.cfg
    tp = b.tp
    hidden = cfg.int("hidden_size", "every projection")
    heads = _split(cfg.int("num_attention_heads", "attention"), tp, "num_attention_heads")
    q_lora = cfg.get("q_lora_rank")
    kv_lora = cfg.int("kv_lora_rank", "MLA")
    nope = cfg.int("qk_nope_head_dim", "MLA")
    rope = cfg.int("qk_rope_head_dim", "MLA")
    v_dim = cfg.int("v_head_dim", "MLA")
    if q_lora:
        attn = [
            _Gemm(
                "self_attn.fused_qkv_a_proj_with_mqa",
                ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                int(q_lora) + kv_lora + rope,
                hidden,
                "none",
            ),
            _Gemm(
                "self_attn.q_b_proj", ("self_attn.q_b_proj",), heads * (nope + rope), q_lora, "N"
            ),
        ]
    else:
        attn = [
            _Gemm("self_attn.q_proj", ("self_attn.q_proj",), heads * (nope + rope), hidden, "N"),
            _Gemm(
                "self_attn.kv_a_proj_with_mqa",
                ("self_attn.kv_a_proj_with_mqa",),
                kv_lora + rope,
                hidden,
                "none",
            ),
        ]
    attn += [
        _Gemm(
            "self_attn.kv_b_proj", ("self_attn.kv_b_proj",), heads * (nope + v_dim), kv_lora, "N"
        ),
        _Gemm("self_attn.o_proj", ("self_attn.o_proj",), hidden, heads * v_dim, "K"),
    ]
    b.note(
        "MLA: kv_b_proj is included as engines run it in prefill; decode absorbs it into "
        "batched matmuls that are not mm_fp4"
    )
    first_dense = cfg.int("first_k_dense_replace", default=0)
    freq = cfg.int("moe_layer_freq", default=1) or 1
    routed = cfg.int("n_routed_experts", default=0)
    n_shared = cfg.int("n_shared_experts", default=0)
    if routed:
        b.moe_notes()
    layers = cfg.int("num_hidden_layers", "the layer count")
    for i in range(layers):
        gemms = list(attn)
        if routed and i >= first_dense and i % freq == 0:
            if n_shared:
                moe_inter = cfg.int("moe_intermediate_size", "the shared experts")
                gemms += b.mlp(hidden, moe_inter * n_shared, "mlp.shared_experts")
        else:
            gemms += b.mlp(hidden, cfg.int("intermediate_size", "the dense MLP layers"))
        b.per_layer.append(gemms)
    if cfg.int("num_nextn_predict_layers", default=0):
        b.note("MTP (next-n prediction) layers are left out: they serve speculative decoding")


def _gpt_oss(b: _Builder) -> None:
    """gpt-oss: attention (with sinks) in every layer, MoE MLP in every layer."""
    cfg = b.cfg
    hidden, heads, kv, head_dim = _hidden_heads(cfg)
    b.moe_notes()
    for _ in range(cfg.int("num_hidden_layers", "the layer count")):
        b.per_layer.append(b.attention(hidden, heads, kv, head_dim))


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
    for i, gemms in enumerate(builder.per_layer):
        for g in gemms:
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
