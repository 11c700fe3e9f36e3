"""SGLang plugin: its dense FP4 GEMMs go through fp4select, tuned when the model is loaded.

Turn it on with ``SGLANG_PLUGINS=fp4select`` (SGLang's plugin allow-list; add other plugins to
the comma list) or ``FP4SELECT_ENGINE_PLUGIN=1``; from code, ``patch()`` / ``unpatch()``. The
entry point patches only a process that has imported the call site's module: SGLang's
scheduler process has (scheduler.py imports it before ``load_plugins()``); the HTTP server and
detokenizer processes, which run no GEMM, have not.

Design rules (the shared ones are in :mod:`fp4select.integrations._common`):

* The patch target is the module global ``sglang.srt.layers.quantization.modelopt_quant.
  flashinfer_fp4_gemm``: ``fp4_gemm`` (a custom op used by the ModelOpt and the
  compressed-tensors W4A4 NVFP4 paths, eager, custom-op and compiled alike) looks it up at call
  time. ``flashinfer.mm_fp4`` itself is left alone: SGLang bound its own name at import.
* SGLang passes a concrete ``backend=`` from ``--fp4-gemm-backend`` and prepared the weights
  for it; fp4select then selects among the backends that read that layout (trtllm: shuffled;
  cutlass, cudnn, cute-dsl: plain 128x4). Marlin never calls mm_fp4 and is left alone, as is the
  W4A16 mode (``mm_bf16_fp4``).
* Tuning at load: ``ModelRunner.initialize`` is wrapped; after it returns (weights loaded and
  post-processed, every post-load transform applied, "before the KV cache is sized" in SGLang's
  own words) the FP4 linear layers' (N, K) are tuned for every M bucket up to the server's
  largest batch: ``max(cuda_graph_max_bs_decode x speculative_num_draft_tokens,
  chunked_prefill_size or max_prefill_tokens)``. The sandbox worker is closed before memory
  pools are allocated. Misses during graph capture fall back without tuning (fp4select's api).
* Not covered: the diffusion runtime (``sglang.multimodal_gen``) caches ``flashinfer.mm_fp4``
  in an ``lru_cache`` on first use and is not patched.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Any

import torch

from fp4select.integrations import _common
from fp4select.integrations._common import LAYOUT_OF_BACKEND, LinearShape, PatchSet, log

ENGINE = "SGLang"
DIST = "sglang"
TESTED_VERSIONS = ("0.5.23",)
ALLOW_LIST_ENV = "SGLANG_PLUGINS"
TARGET_MODULE = "sglang.srt.layers.quantization.modelopt_quant"
TARGET_NAME = "flashinfer_fp4_gemm"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"

_patches = PatchSet(ENGINE)


def engine_version() -> str | None:
    """The installed SGLang's version (what the version gate reads)."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def plugin() -> None:
    """Entry point in SGLang's ``sglang.srt.plugins`` group; never raises into SGLang."""
    if not _common.plugin_enabled(ALLOW_LIST_ENV):
        log.debug(
            "fp4select: SGLang plugin installed but off (set %s=fp4select or %s=1)",
            ALLOW_LIST_ENV,
            _common.ENABLE_ENV,
        )
        return
    if TARGET_MODULE not in sys.modules:
        # SGLang's scheduler process (the one that runs the GEMMs) has imported the call site
        # before it loads plugins; the other processes (the HTTP server, the detokenizer) have
        # not, and patching there would only import the model code for nothing.
        log.debug("fp4select: %s not imported in this process; not patching here", TARGET_MODULE)
        return
    try:
        patch()
    except Exception:
        log.exception("fp4select: could not patch SGLang; it runs unchanged")


def is_patched() -> bool:
    """Whether ``patch()`` holds SGLang's call site; never imports SGLang (False without it)."""
    module = sys.modules.get(TARGET_MODULE)
    return module is not None and _patches.holds(module, TARGET_NAME)


def patch(*, tune_at_load: bool | None = None) -> bool:
    """Route SGLang's FP4 GEMM through fp4select; True when SGLang is (now or already) patched.

    ``tune_at_load`` (default: ``FP4SELECT_WARM_AT_LOAD``, on) wraps ``ModelRunner.initialize``
    to tune the loaded model's FP4 layers before memory is sized.
    """
    if engine_version() is None:
        log.info("fp4select: SGLang is not installed; nothing to patch")
        return False
    if not _common.version_allowed(ENGINE, engine_version(), TESTED_VERSIONS):
        return False
    module = importlib.import_module(TARGET_MODULE)
    if _patches.holds(module, TARGET_NAME):
        return True
    original = getattr(module, TARGET_NAME, None)
    if original is None or not getattr(module, "enable_flashinfer_fp4_gemm", False):
        log.info("fp4select: SGLang has no flashinfer mm_fp4 here (import failed); not patching")
        return False
    if getattr(original, "__fp4select__", False):
        log.info("fp4select: %s.%s is already fp4select's", TARGET_MODULE, TARGET_NAME)
        return True
    _common.pin_flashinfer_original()
    tuning = _common.warm_enabled() if tune_at_load is None else tune_at_load
    try:
        _patches.set(module, TARGET_NAME, _common.make_mm_fp4(original, ENGINE))
        if tuning:
            runner_cls = importlib.import_module(RUNNER_MODULE).ModelRunner
            _patches.set(runner_cls, "initialize", _tuning_initialize(runner_cls.initialize))
    except Exception:
        _patches.restore()
        raise
    log.info(
        "fp4select: SGLang %s patched: %s.%s -> fp4select (tuning at load: %s)",
        engine_version(),
        TARGET_MODULE,
        TARGET_NAME,
        "on" if tuning else "off",
    )
    return True


def unpatch() -> list[str]:
    """Put back every object ``patch()`` replaced; returns their names."""
    restored = _patches.restore()
    if restored:
        log.info("fp4select: SGLang unpatched: %s", ", ".join(restored))
    return restored


# -- tuning at load --------------------------------------------------------------------------
def _tuning_initialize(original: Any) -> Any:
    return _common.then_tune(original, lambda self: tune_model_runner(self))


def current_layout() -> str | None:
    """The layout family SGLang prepared its FP4 weights in, or None where mm_fp4 is not used."""
    from sglang.srt.layers.quantization import fp4_utils

    backend = fp4_utils.get_fp4_gemm_runner_backend()
    if backend.is_marlin():
        return None
    return LAYOUT_OF_BACKEND.get(backend.get_flashinfer_backend())


def _is_w4a4_fp4_layer(module: torch.nn.Module) -> bool:
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4LinearMethod

    method = getattr(module, "quant_method", None)
    if isinstance(method, ModelOptFp4LinearMethod):
        return getattr(method, "quant_mode", "w4a4") == "w4a4"
    try:
        from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
            CompressedTensorsW4A4Fp4,
        )
    except Exception:
        return False
    return isinstance(getattr(module, "scheme", None), CompressedTensorsW4A4Fp4)


def model_shapes(
    model: torch.nn.Module, layout: str, out_dtype: str
) -> tuple[list[LinearShape], torch.device | None]:
    """(N, K) of every W4A4 FP4 linear layer as fp4_gemm will pass it, and their device."""
    shapes: set[LinearShape] = set()
    device = None
    for module in model.modules():
        if not _is_w4a4_fp4_layer(module):
            continue
        weight = getattr(module, "weight", None)
        # An empty weight was moved into a fused swiglu kernel that does not call mm_fp4.
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
            continue
        if weight.dtype != torch.uint8:
            continue
        shapes.add(LinearShape(int(weight.shape[0]), 2 * int(weight.shape[1]), out_dtype, layout))
        device = device or weight.device
    return sorted(shapes, key=lambda s: (s.n, s.k)), device


def server_max_m(server_args: Any) -> int:
    """The largest M one FP4 GEMM of this server sees: a decode graph batch or a prefill chunk."""

    def number(name: str) -> int:
        value = getattr(server_args, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    decode = number("cuda_graph_max_bs_decode") or number("max_running_requests")
    decode *= max(1, number("speculative_num_draft_tokens"))
    prefill = number("chunked_prefill_size")
    if prefill <= 0:
        prefill = number("max_prefill_tokens") or 16384
    return max(decode, prefill, 1)


def tune_model_runner(runner: Any) -> dict[str, Any]:
    """Tune the FP4 layers a loaded ``ModelRunner`` holds; returns the summary."""
    layout = current_layout()
    if layout is None:
        log.info("fp4select: SGLang's FP4 backend does not call mm_fp4 here; nothing to tune")
        return {"engine": ENGINE, "problems": 0}
    dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    out_dtype = "float16" if dtype == torch.float16 else "bfloat16"
    shapes, device = model_shapes(runner.model, layout, out_dtype)
    max_m = _common.warm_max_m(server_max_m(getattr(runner, "server_args", None)))
    return _common.tune_at_load(ENGINE, shapes, max_m, device or torch.device("cpu"))
