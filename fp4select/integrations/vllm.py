"""vLLM plugin: its FlashInfer NVFP4 linear kernels go through fp4select, tuned at model load.

Turn it on with ``VLLM_PLUGINS=fp4select`` (vLLM's plugin allow-list; add other plugins to the
comma list) or ``FP4SELECT_ENGINE_PLUGIN=1``; from code, ``patch()`` / ``unpatch()``.

Design rules (the shared ones are in :mod:`fp4select.integrations._common`):

* The patch target is the attribute ``flashinfer.mm_fp4``: vLLM's custom op
  ``vllm::flashinfer_mm_fp4`` imports it on every call, so every FlashInfer NVFP4 linear kernel
  (cutlass, cute-dsl, trtllm, cudnn, b12x) reaches fp4select while the op stays opaque to
  torch.compile. The custom op itself is not replaced.
* vLLM prepared the weights at load for the backend it names in each call (trtllm: shuffled;
  the others plain 128x4) and sends 8x4 activation scales to trtllm at M <= 32; fp4select
  selects among the backends that read those layouts. ``--linear-backend`` values that do not
  go through flashinfer's mm_fp4 (vLLM's own cutlass, marlin, emulation, ...) are untouched.
* Tuning at load: ``Worker.load_model`` is wrapped; after it returns, the FP4 layers' (N, K) are
  tuned for every M bucket up to ``max_num_batched_tokens`` (the profile run's size, which
  bounds every graph size too), and the sandbox worker is closed, all before
  ``determine_available_memory`` profiles memory.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Any

import torch

from fp4select.integrations import _common
from fp4select.integrations._common import LinearShape, PatchSet, log

ENGINE = "vLLM"
DIST = "vllm"
TESTED_VERSIONS = ("0.33.0",)
ALLOW_LIST_ENV = "VLLM_PLUGINS"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
KERNEL_MODULE = "vllm.model_executor.kernels.linear.nvfp4.flashinfer"
# vLLM's FlashInfer NVFP4 W4A4 kernel classes -> the backend each passes to mm_fp4.
KERNEL_BACKENDS = {
    "FlashInferCutlassNvFp4LinearKernel": "cutlass",
    "FlashInferCuteDslNvFp4LinearKernel": "cute-dsl",
    "FlashInferTrtllmNvFp4LinearKernel": "trtllm",
    "FlashInferCudnnNvFp4LinearKernel": "cudnn",
    "FlashInferB12xNvFp4LinearKernel": "b12x",
}

_patches = PatchSet(ENGINE)


def engine_version() -> str | None:
    """The installed vLLM's version (what the version gate reads)."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def plugin() -> None:
    """Entry point in vLLM's ``vllm.general_plugins`` group; never raises into vLLM."""
    if not _common.plugin_enabled(ALLOW_LIST_ENV):
        log.debug(
            "fp4select: vLLM plugin installed but off (set %s=fp4select or %s=1)",
            ALLOW_LIST_ENV,
            _common.ENABLE_ENV,
        )
        return
    try:
        patch()
    except Exception:
        log.exception("fp4select: could not patch vLLM; it runs unchanged")


def is_patched() -> bool:
    """Whether ``patch()`` holds ``flashinfer.mm_fp4``; never imports flashinfer."""
    flashinfer = sys.modules.get("flashinfer")
    return flashinfer is not None and _patches.holds(flashinfer, "mm_fp4")


def patch(*, tune_at_load: bool | None = None) -> bool:
    """Route vLLM's FlashInfer NVFP4 GEMMs through fp4select; True when patched.

    ``tune_at_load`` (default: ``FP4SELECT_WARM_AT_LOAD``, on) wraps ``Worker.load_model`` to
    tune the loaded model's FP4 layers before vLLM profiles memory.
    """
    if engine_version() is None:
        # flashinfer.mm_fp4 is process-wide: without vLLM there is nothing of vLLM's to route.
        log.info("fp4select: vLLM is not installed; flashinfer.mm_fp4 left alone")
        return False
    if not _common.version_allowed(ENGINE, engine_version(), TESTED_VERSIONS):
        return False
    try:
        import flashinfer
    except Exception as exc:
        log.info("fp4select: flashinfer is not importable (%s); vLLM not patched", exc)
        return False
    if _patches.holds(flashinfer, "mm_fp4"):
        return True
    original = getattr(flashinfer, "mm_fp4", None)
    if original is None:
        log.info("fp4select: this flashinfer has no mm_fp4; vLLM not patched")
        return False
    if getattr(original, "__fp4select__", False):
        log.info("fp4select: flashinfer.mm_fp4 is already fp4select's")
        return True
    _common.pin_flashinfer_original()
    tuning = _common.warm_enabled() if tune_at_load is None else tune_at_load
    try:
        _patches.set(flashinfer, "mm_fp4", _common.make_mm_fp4(original, ENGINE))
        if tuning:
            worker_cls = importlib.import_module(WORKER_MODULE).Worker
            _patches.set(worker_cls, "load_model", _tuning_load_model(worker_cls.load_model))
    except Exception:
        _patches.restore()
        raise
    log.info(
        "fp4select: vLLM %s patched: flashinfer.mm_fp4 -> fp4select (tuning at load: %s)",
        engine_version(),
        "on" if tuning else "off",
    )
    return True


def unpatch() -> list[str]:
    """Put back every object ``patch()`` replaced; returns their names."""
    restored = _patches.restore()
    if restored:
        log.info("fp4select: vLLM unpatched: %s", ", ".join(restored))
    return restored


# -- tuning at load --------------------------------------------------------------------------
def _tuning_load_model(original: Any) -> Any:
    return _common.then_tune(original, lambda self: tune_worker(self))


def _kernel_backend(module: torch.nn.Module) -> str | None:
    for holder in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        kernel = getattr(holder, "kernel", None)
        if kernel is None:
            continue
        cls = type(kernel)
        if cls.__module__ == KERNEL_MODULE and cls.__name__ in KERNEL_BACKENDS:
            return KERNEL_BACKENDS[cls.__name__]
    return None


def model_shapes(
    model: torch.nn.Module, out_dtype: str
) -> tuple[list[LinearShape], torch.device | None]:
    """(N, K) and layout of every linear layer served by a FlashInfer NVFP4 kernel."""
    shapes: set[LinearShape] = set()
    device = None
    for module in model.modules():
        backend = _kernel_backend(module)
        layout = _common.LAYOUT_OF_BACKEND.get(backend) if backend else None
        weight = getattr(module, "weight", None)
        if layout is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if weight.dtype != torch.uint8 or weight.numel() == 0:
            continue
        shapes.add(
            LinearShape(
                int(weight.shape[0]),
                2 * int(weight.shape[1]),
                out_dtype,
                layout,
                small_m_8x4=layout == "trtllm",
            )
        )
        device = device or weight.device
    return sorted(shapes, key=lambda s: (s.n, s.k, s.b_layout)), device


def tune_worker(worker: Any) -> dict[str, Any]:
    """Tune the FP4 layers a vLLM ``Worker`` has loaded; returns the summary."""
    model = worker.model_runner.get_model()
    dtype = getattr(getattr(worker, "model_config", None), "dtype", None)
    out_dtype = "float16" if dtype == torch.float16 else "bfloat16"
    shapes, device = model_shapes(model, out_dtype)
    scheduler = getattr(getattr(worker, "vllm_config", None), "scheduler_config", None)
    engine_max_m = getattr(scheduler, "max_num_batched_tokens", None) or 8192
    max_m = _common.warm_max_m(engine_max_m)
    return _common.tune_at_load(ENGINE, shapes, max_m, device or torch.device("cpu"))
