"""vLLM plugin: its FlashInfer NVFP4 linear kernels go through fp4select, tuned at model load.

How to turn it on and what it covers: docs/engines.md.

Design rules (the shared ones are in :mod:`fp4select.integrations._common`):

* The patch target is the attribute ``flashinfer.mm_fp4``: the body of vLLM's custom op
  ``vllm::flashinfer_mm_fp4`` (from 0.34 called directly in eager mode, through the op only
  under torch.compile) imports it on every call, so every FlashInfer NVFP4 linear kernel
  reaches fp4select while the op stays opaque to torch.compile. The op itself is not replaced.
* vLLM prepared the weights at load for the backend it names in each call (trtllm: shuffled;
  the others plain 128x4) and sends 8x4 activation scales to trtllm at M <= 32; fp4select
  selects among the backends that read those layouts. ``--linear-backend`` values that do not
  go through flashinfer's mm_fp4 are untouched.
* Tuning at load: ``Worker.load_model`` is wrapped; after it returns, the FP4 layers' (N, K) are
  tuned for every M bucket up to ``max_num_batched_tokens`` (which bounds every graph size
  too) and the sandbox worker is closed, all before ``determine_available_memory``.
* GPUs without FP4 tensor cores (SM80-SM90), where vLLM's W4A4 kernels all say no and Marlin
  serves W4A16: ``Fp4selectNvFp4LinearKernel`` goes into ``_POSSIBLE_NVFP4_KERNELS`` ahead of
  the weight-only kernels, so ``init_nvfp4_linear_kernel`` picks it where fp4select has a GPU
  kernel (``_common.w4a4_unavailable``); it computes W4A4 as the checkpoint was calibrated
  (:mod:`fp4select.integrations._layer`). It is also a ``--linear-backend`` value,
  ``fp4select`` (in ``_LINEAR_BACKEND_KERNEL_MAP`` and the CLI's choices), on any GPU from
  SM80; on Blackwell the ``mm_fp4`` patch still serves vLLM's own FlashInfer kernels, so both
  routes exist. ``linear_backend_per_quant`` and ``--kernel-config`` do not take the name.
"""

from __future__ import annotations

import importlib
import sys
import typing
from typing import Any

import torch

from fp4select.integrations import _common
from fp4select.integrations._common import LinearShape, PatchSet, log
from fp4select.keys import installed_version

ENGINE = "vLLM"
DIST = "vllm"
TESTED_VERSIONS = ("0.33.0", "0.34.0")
ALLOW_LIST_ENV = "VLLM_PLUGINS"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
LINEAR_MODULE = "vllm.model_executor.kernels.linear"
LINEAR_BACKEND = "fp4select"  # the --linear-backend value
KERNEL_NAME = "Fp4selectNvFp4LinearKernel"
# The first weight-only kernel in vLLM's CUDA list: fp4select's W4A4 kernel goes just before.
WEIGHT_ONLY_KERNELS = ("FlashInferCuteDslNvFp4W4A16LinearKernel", "MarlinNvFp4LinearKernel")
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
    return installed_version(DIST)


def plugin() -> None:
    """Entry point in vLLM's ``vllm.general_plugins`` group; never raises into vLLM."""
    _common.run_plugin(ENGINE, ALLOW_LIST_ENV, patch)


def is_patched() -> bool:
    """Whether ``patch()`` holds vLLM's kernel list; never imports vLLM (False without it)."""
    module = sys.modules.get(LINEAR_MODULE)
    return module is not None and _patches.holds(module, "_POSSIBLE_NVFP4_KERNELS")


def patch(*, tune_at_load: bool | None = None) -> bool:
    """Route vLLM's FlashInfer NVFP4 GEMMs through fp4select; True when patched.

    ``tune_at_load`` (default: ``FP4SELECT_WARM_AT_LOAD``, on) wraps ``Worker.load_model`` to
    tune the loaded model's FP4 layers before vLLM profiles memory.
    """
    version = engine_version()
    if version is None:
        # flashinfer.mm_fp4 is process-wide: without vLLM there is nothing of vLLM's to route.
        log.info("fp4select: vLLM is not installed; flashinfer.mm_fp4 left alone")
        return False
    if not _common.version_allowed(ENGINE, version, TESTED_VERSIONS):
        return False
    if _patches:
        return True
    tuning = _common.warm_enabled() if tune_at_load is None else tune_at_load
    try:
        mm_fp4 = _patch_mm_fp4()
        _register_kernel()
        if tuning:
            worker_cls = importlib.import_module(WORKER_MODULE).Worker
            tuned = _common.then_tune(worker_cls.load_model, lambda self: tune_worker(self))
            _patches.set(worker_cls, "load_model", tuned)
    except Exception:
        _patches.restore()
        raise
    log.info(
        "fp4select: vLLM %s patched: %s; NVFP4 linear kernel %s registered (--linear-backend "
        "%s; ahead of Marlin on SM80-SM90); tuning at load: %s",
        version,
        "flashinfer.mm_fp4 -> fp4select" if mm_fp4 else "flashinfer.mm_fp4 not patched",
        KERNEL_NAME,
        LINEAR_BACKEND,
        "on" if tuning else "off",
    )
    return True


def _patch_mm_fp4() -> bool:
    """Route vLLM's FlashInfer kernels' ``flashinfer.mm_fp4`` through fp4select, if present."""
    try:
        import flashinfer
    except Exception as exc:
        log.info("fp4select: flashinfer is not importable (%s); its mm_fp4 is not patched", exc)
        return False
    original = getattr(flashinfer, "mm_fp4", None)
    if original is None:
        log.info("fp4select: this flashinfer has no mm_fp4; not patched")
        return False
    if getattr(original, "__fp4select__", False):
        log.info("fp4select: flashinfer.mm_fp4 is already fp4select's")
        return False
    _common.pin_flashinfer_original()
    _patches.set(flashinfer, "mm_fp4", _common.make_mm_fp4(original, ENGINE))
    return True


def _register_kernel() -> None:
    """fp4select's kernel class into vLLM's NVFP4 list, the --linear-backend map and the CLI."""
    from vllm.platforms.interface import PlatformEnum

    linear = importlib.import_module(LINEAR_MODULE)
    cls = kernel_class()
    possible = dict(linear._POSSIBLE_NVFP4_KERNELS)
    cuda = list(possible.get(PlatformEnum.CUDA, []))
    names = [k.__name__ for k in cuda]
    at = min((names.index(n) for n in WEIGHT_ONLY_KERNELS if n in names), default=len(cuda))
    cuda.insert(at, cls)
    possible[PlatformEnum.CUDA] = cuda
    _patches.set(linear, "_POSSIBLE_NVFP4_KERNELS", possible)
    by_name = dict(linear._LINEAR_BACKEND_KERNEL_MAP)
    by_name[LINEAR_BACKEND] = {cls}
    _patches.set(linear, "_LINEAR_BACKEND_KERNEL_MAP", by_name)
    # The CLI builds --linear-backend's choices from KernelConfig's Literal (after plugins load).
    from vllm.config.kernel import KernelConfig

    field = KernelConfig.__dataclass_fields__["linear_backend"]
    choices = typing.get_args(field.type)
    if LINEAR_BACKEND not in choices:
        widened: Any = typing.Literal.__getitem__((*choices, LINEAR_BACKEND))
        _patches.set(field, "type", widened)
    _forget_cli_choices()


def _forget_cli_choices() -> None:
    """Drop vLLM's cached argparse kwargs, so the parser's choices follow the Literal."""
    try:
        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        arg_utils._compute_kwargs.cache_clear()
    except Exception:  # the CLI helper moved: the Python API still takes the name
        log.debug("fp4select: could not refresh vLLM's CLI choices", exc_info=True)


def unpatch() -> list[str]:
    """Put back every object ``patch()`` replaced; returns their names."""
    restored = _common.unpatch(_patches)
    if restored:
        _forget_cli_choices()
    return restored


# -- fp4select's NVFP4 linear kernel (W4A4) -------------------------------------------------
_kernel_class: Any = None


def _configured_backend() -> str:
    linear = importlib.import_module(LINEAR_MODULE)
    return str(linear._get_linear_backend(quantization="nvfp4_w4a4"))


def kernel_supported(compute_capability: int | None = None) -> tuple[bool, str | None]:
    """vLLM's ``is_supported`` answer for fp4select's kernel: named, from SM80; unnamed, only
    where vLLM has no W4A4 kernel of its own (SM80-SM90), and only with a fp4select GPU kernel."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False, "fp4select's NVFP4 kernel runs on CUDA GPUs"
    if compute_capability is None:
        capability = current_platform.get_device_capability()
        compute_capability = None if capability is None else capability.to_int()
    named = _configured_backend() == LINEAR_BACKEND
    if not named and compute_capability is not None and compute_capability >= _common.NATIVE_FP4_CC:
        return False, (
            "on SM100+ vLLM's own FP4 kernels serve (through fp4select's flashinfer.mm_fp4); "
            f"--linear-backend {LINEAR_BACKEND} chooses this one"
        )
    why = _common.w4a4_unavailable(compute_capability)
    return (why is None), why


def kernel_class() -> type:
    """``Fp4selectNvFp4LinearKernel``, a subclass of vLLM's ``NvFp4LinearKernel`` (made once)."""
    global _kernel_class
    if _kernel_class is not None:
        return _kernel_class
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
    from vllm.model_executor.utils import replace_parameter

    from fp4select.integrations import _layer

    class Fp4selectNvFp4LinearKernel(NvFp4LinearKernel):
        """NVFP4 W4A4 through fp4select: activations quantized with the layer's static input
        scale (flashinfer's recipe), then ``best_mm_fp4`` on the checkpoint's weight layout."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return kernel_supported(compute_capability)

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            return True, None

        def process_weights_after_loading(self, layer: Any) -> None:
            replace_parameter(
                layer, "weight_scale", _layer.prepare_weight_scale(layer.weight_scale.data)
            )
            self._op = _layer.linear_op()

        def apply_weights(
            self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            out = self._op(
                x,
                layer.weight,
                layer.weight_scale,
                layer.input_global_scale_inv,
                layer.alpha,
                x.dtype,
            )
            return out if bias is None else out + bias

    Fp4selectNvFp4LinearKernel.__module__ = __name__
    _kernel_class = Fp4selectNvFp4LinearKernel
    return _kernel_class


# -- tuning at load --------------------------------------------------------------------------
def _layout(module: torch.nn.Module) -> str | None:
    """The weight layout of the kernel that serves ``module``, if it calls mm_fp4."""
    for holder in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        kernel = getattr(holder, "kernel", None)
        if kernel is None:
            continue
        cls = type(kernel)
        if _kernel_class is not None and cls is _kernel_class:
            return "plain"  # fp4select's own kernel: the checkpoint's layout
        if cls.__module__ == KERNEL_MODULE and cls.__name__ in KERNEL_BACKENDS:
            return _common.LAYOUT_OF_BACKEND.get(KERNEL_BACKENDS[cls.__name__])
    return None


def model_shapes(
    model: torch.nn.Module, out_dtype: str
) -> tuple[list[LinearShape], torch.device | None]:
    """(N, K) and layout of every linear layer served by a FlashInfer NVFP4 kernel."""
    return _common.linear_shapes(model, _layout, out_dtype, small_m_8x4=True)


def tune_worker(worker: Any) -> dict[str, Any]:
    """Tune the FP4 layers a vLLM ``Worker`` has loaded; returns the summary."""
    model = worker.model_runner.get_model()
    shapes, device = model_shapes(model, _common.out_dtype_of(worker))
    scheduler = getattr(getattr(worker, "vllm_config", None), "scheduler_config", None)
    engine_max_m = getattr(scheduler, "max_num_batched_tokens", None) or 8192
    max_m = _common.warm_max_m(engine_max_m)
    return _common.tune_at_load(ENGINE, shapes, max_m, device or torch.device("cpu"))
