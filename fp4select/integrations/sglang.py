"""SGLang plugin: its dense FP4 GEMMs go through fp4select, tuned when the model is loaded.

How to turn it on and what it covers: docs/engines.md. The entry point patches only a process
that has imported the call site's module: SGLang's scheduler has (before ``load_plugins()``);
the HTTP server and detokenizer, which run no GEMM, have not.

Design rules (the shared ones are in :mod:`fp4select.integrations._common`):

* The patch target is the module global ``sglang.srt.layers.quantization.modelopt_quant.
  flashinfer_fp4_gemm``, which ``fp4_gemm`` (ModelOpt and compressed-tensors W4A4 NVFP4,
  eager, custom-op and compiled alike) looks up at call time. ``flashinfer.mm_fp4`` is left
  alone: SGLang bound its own name at import.
* SGLang passes a concrete ``backend=`` from ``--fp4-gemm-backend`` and prepared the weights
  for it; fp4select selects among the backends that read that layout. Marlin and the W4A16
  mode (``mm_bf16_fp4``) never call mm_fp4 and are left alone.
* Tuning at load: ``ModelRunner.initialize`` is wrapped; after it returns (weights loaded and
  post-processed, "before the KV cache is sized" in SGLang's words) the FP4 layers' (N, K) are
  tuned for every M bucket up to the server's largest batch, and the sandbox worker is closed
  before memory pools are allocated.
* GPUs without FP4 tensor cores (SM80-SM90): SGLang serves ModelOpt NVFP4 there only through
  Marlin (a named FlashInfer backend raises "ModelOpt NVFP4 native dense GEMM backends require
  SM100+"). With the plugin on and a fp4select GPU kernel there (``_common.w4a4_unavailable``):
  ``auto`` resolves to ``flashinfer_cutlass`` (the plain 128x4 layout fp4select's kernels
  read; the wrapped ``initialize_fp4_gemm_config``), the SM100 gate is lifted for that one
  call (``get_platform`` rebound in ``modelopt_quant`` for its duration, so SGLang's own
  padding and scale swizzle run unchanged), and ``modelopt_quant.fp4_quantize`` (flashinfer's,
  refused below SM100) gives way to :func:`fp4select.quantize.fp4_quantize`. ``apply`` stays
  SGLang's; its GEMM is the patched one: W4A4, the numbers Blackwell computes.
* Not covered: the compressed-tensors W4A4 scheme below SM100 (SGLang serves it weight-only)
  and the diffusion runtime (``sglang.multimodal_gen``), which caches ``flashinfer.mm_fp4`` in
  an ``lru_cache`` on first use.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from typing import Any

import torch

from fp4select.integrations import _common
from fp4select.integrations._common import LAYOUT_OF_BACKEND, LinearShape, PatchSet, log
from fp4select.keys import installed_version

ENGINE = "SGLang"
DIST = "sglang"
TESTED_VERSIONS = ("0.5.23",)
ALLOW_LIST_ENV = "SGLANG_PLUGINS"
TARGET_MODULE = "sglang.srt.layers.quantization.modelopt_quant"
TARGET_NAME = "flashinfer_fp4_gemm"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
FP4_UTILS_MODULE = "sglang.srt.layers.quantization.fp4_utils"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"

_patches = PatchSet(ENGINE)


def engine_version() -> str | None:
    """The installed SGLang's version (what the version gate reads)."""
    return installed_version(DIST)


def plugin() -> None:
    """Entry point in SGLang's ``sglang.srt.plugins`` group; never raises into SGLang."""
    _common.run_plugin(ENGINE, ALLOW_LIST_ENV, _patch_if_scheduler)


def _patch_if_scheduler() -> None:
    if TARGET_MODULE not in sys.modules:
        # SGLang's scheduler process (the one that runs the GEMMs) has imported the call site
        # before it loads plugins; the other processes (the HTTP server, the detokenizer) have
        # not, and patching there would only import the model code for nothing.
        log.debug("fp4select: %s not imported in this process; not patching here", TARGET_MODULE)
        return
    patch()


def is_patched() -> bool:
    """Whether ``patch()`` holds SGLang's call site; never imports SGLang (False without it)."""
    module = sys.modules.get(TARGET_MODULE)
    return module is not None and _patches.holds(module, TARGET_NAME)


def patch(*, tune_at_load: bool | None = None) -> bool:
    """Route SGLang's FP4 GEMM through fp4select; True when SGLang is (now or already) patched.

    ``tune_at_load`` (default: ``FP4SELECT_WARM_AT_LOAD``, on) wraps ``ModelRunner.initialize``
    to tune the loaded model's FP4 layers before memory is sized.
    """
    version = engine_version()
    if version is None:
        log.info("fp4select: SGLang is not installed; nothing to patch")
        return False
    if not _common.version_allowed(ENGINE, version, TESTED_VERSIONS):
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
        _patch_below_sm100(module)
        if tuning:
            runner_cls = importlib.import_module(RUNNER_MODULE).ModelRunner
            tuned = _common.then_tune(runner_cls.initialize, lambda self: tune_model_runner(self))
            _patches.set(runner_cls, "initialize", tuned)
    except Exception:
        _patches.restore()
        raise
    log.info(
        "fp4select: SGLang %s patched: %s.%s -> fp4select (tuning at load: %s)",
        version,
        TARGET_MODULE,
        TARGET_NAME,
        "on" if tuning else "off",
    )
    return True


# -- GPUs without FP4 tensor cores ----------------------------------------------------------
def _patch_below_sm100(module: Any) -> None:
    fp4_utils = importlib.import_module(FP4_UTILS_MODULE)
    initialize = _serving_initialize(fp4_utils.initialize_fp4_gemm_config)
    _patches.set(fp4_utils, "initialize_fp4_gemm_config", initialize)
    scheduler = sys.modules.get(SCHEDULER_MODULE)  # it bound the name at import
    if scheduler is not None and hasattr(scheduler, "initialize_fp4_gemm_config"):
        _patches.set(scheduler, "initialize_fp4_gemm_config", initialize)
    method = module.ModelOptFp4LinearMethod
    _patches.set(
        method,
        "process_weights_after_loading",
        _gated_process_weights(method.process_weights_after_loading),
    )
    if getattr(module, "fp4_quantize", None) is not None:
        _patches.set(module, "fp4_quantize", _quantize_below_sm100(module.fp4_quantize))


def device_cc() -> int | None:
    """The GPU's compute capability as SGLang reads it (``fp4_utils.get_device_capability``)."""
    fp4_utils = importlib.import_module(FP4_UTILS_MODULE)
    try:
        major, minor = fp4_utils.get_device_capability()
    except Exception:
        return None
    if major is None or minor is None:
        return None
    return int(major) * 10 + int(minor)


def serves_below_sm100() -> bool:
    """Whether fp4select serves SGLang's NVFP4 dense GEMMs on this (pre-SM100) GPU."""
    cc = device_cc()
    return cc is not None and cc < _common.NATIVE_FP4_CC and _common.w4a4_unavailable(cc) is None


def _configured_backend() -> str | None:
    fp4_utils = importlib.import_module(FP4_UTILS_MODULE)
    try:
        return str(fp4_utils.get_exec().kernel.fp4_gemm_runner_backend)
    except Exception:
        return None


def _serving_initialize(original: Any) -> Any:
    """``initialize_fp4_gemm_config``, then: ``auto`` that chose Marlin below SM100 chooses
    ``flashinfer_cutlass`` (served by fp4select) when fp4select has a kernel for this GPU."""

    @functools.wraps(original)
    def initialize_fp4_gemm_config() -> None:
        original()
        fp4_utils = importlib.import_module(FP4_UTILS_MODULE)
        backend = fp4_utils.FP4_GEMM_RUNNER_BACKEND
        if backend is None or not backend.is_marlin() or _configured_backend() != "auto":
            return  # the user named a backend (Marlin included): theirs to keep
        if not serves_below_sm100():
            return
        chosen = fp4_utils.Fp4GemmRunnerBackend.FLASHINFER_CUTLASS
        _patches.set(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", chosen)
        log.info(
            "fp4select: SGLang --fp4-gemm-backend auto on SM%s: NVFP4 dense GEMMs run W4A4 "
            "through fp4select (%s) instead of Marlin W4A16; --fp4-gemm-backend marlin keeps "
            "Marlin",
            device_cc(),
            chosen.value,
        )

    return initialize_fp4_gemm_config


class _BlackwellGate:
    """SGLang's platform facts with ``is_blackwell`` true: lifts the SM100 gate, nothing else."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    is_blackwell = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


_gate_lock = threading.Lock()


def _gated_process_weights(original: Any) -> Any:
    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        module = importlib.import_module(TARGET_MODULE)
        backend = module.get_fp4_gemm_runner_backend()
        if (
            getattr(self, "quant_mode", "w4a4") != "w4a4"
            or not backend.is_flashinfer()
            or module.get_platform().is_blackwell
            or not serves_below_sm100()
        ):
            return original(self, layer)
        platform = module.get_platform
        with _gate_lock:
            setattr(module, "get_platform", lambda: _BlackwellGate(platform()))  # noqa: B010
            try:
                return original(self, layer)
            finally:
                setattr(module, "get_platform", platform)  # noqa: B010

    return process_weights_after_loading


def _quantize_below_sm100(original: Any) -> Any:
    """SGLang's ``fp4_quantize`` (flashinfer's, SM100+) with fp4select's below SM100 and on
    the CPU; the same outputs: ``(M, K/2)`` uint8 and the 128x4 scales as uint8."""
    from fp4select.quantize import fp4_quantize as fp4select_quantize

    native: dict[int, bool] = {}

    def fp4_quantize(input: torch.Tensor, global_scale: Any = None, *args: Any, **kwargs: Any):
        if input.is_cuda:
            index = input.device.index if input.device.index is not None else 0
            if index not in native:
                major, _ = torch.cuda.get_device_capability(index)
                native[index] = major * 10 >= _common.NATIVE_FP4_CC
            if native[index]:
                return original(input, global_scale, *args, **kwargs)
        if (
            args
            or any(kwargs.get(k) for k in ("sf_use_ue8m0", "is_sf_8x4_layout"))
            or kwargs.get("sf_vec_size", 16) != 16
            or not kwargs.get("is_sf_swizzled_layout", True)
        ):
            raise NotImplementedError(
                "fp4select's NVFP4 quantizer makes 16-value blocks with 128x4 e4m3 scales only"
            )
        x = input.reshape(-1, input.shape[-1])
        packed, scales = fp4select_quantize(x, global_scale)
        return packed.reshape(*input.shape[:-1], -1), scales.view(torch.uint8)

    fp4_quantize.__fp4select__ = True  # type: ignore[attr-defined]
    return fp4_quantize


def unpatch() -> list[str]:
    """Put back every object ``patch()`` replaced; returns their names."""
    return _common.unpatch(_patches)


# -- tuning at load --------------------------------------------------------------------------
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
    return _common.linear_shapes(
        model, lambda module: layout if _is_w4a4_fp4_layer(module) else None, out_dtype
    )


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
    out_dtype = _common.out_dtype_of(runner)
    shapes, device = model_shapes(runner.model, layout, out_dtype)
    max_m = _common.warm_max_m(server_max_m(getattr(runner, "server_args", None)))
    return _common.tune_at_load(ENGINE, shapes, max_m, device or torch.device("cpu"))
