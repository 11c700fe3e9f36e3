"""The vLLM plugin against the real vLLM package, on the CPU.

Run by .ci/engines.sh in an environment with vLLM installed without its GPU dependencies, once
for each version the plugin was tested with; skipped elsewhere. vLLM's ``vllm::flashinfer_mm_fp4``
op is registered for CUDA only. In 0.33 every call goes through the op: these tests give it a
CPU kernel made of its own Python body (``op._init_fn``). From 0.34 an eager call skips the
dispatcher and runs the body (``_flashinfer_mm_fp4``) itself. Either way a call through
``flashinfer_scaled_fp4_mm`` runs the op's body, which imports ``flashinfer.mm_fp4``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import types
import typing

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed here (.ci/engines.sh builds the engine test environment)",
        allow_module_level=True,
    )

import flashinfer
import flashinfer.gemm.gemm_base as gemm_base
import vllm.model_executor.kernels.linear as vllm_linear
import vllm.plugins as vllm_plugins
import vllm.utils.flashinfer as vllm_flashinfer
from test_integrations_common import (
    PLAIN_ONLY,
    SHUFFLED_ONLY,
    assert_exact,
    assert_family,
    calls,
    problem_for,
    register_layout_backends,
)
from vllm.model_executor.kernels.linear.nvfp4 import flashinfer as vllm_kernels
from vllm.platforms.interface import PlatformEnum
from vllm.v1.worker.gpu_worker import Worker

import fp4select
from fp4select.backends import flashinfer as fi_backend
from fp4select.integrations import _common
from fp4select.integrations import vllm as integration
from fp4select.validate import make_inputs

pytestmark = pytest.mark.engines


def _objects() -> dict[str, object]:
    """Every object the plugin may change, by identity."""
    return {
        "flashinfer.mm_fp4": flashinfer.mm_fp4,
        "gemm_base.mm_fp4": gemm_base.mm_fp4,
        "Worker.load_model": vars(Worker)["load_model"],
        "vllm op": vllm_flashinfer.flashinfer_mm_fp4,
        "vllm op body": _op_body(),
        "NVFP4 kernels": vllm_linear._POSSIBLE_NVFP4_KERNELS,
        "backend map": vllm_linear._LINEAR_BACKEND_KERNEL_MAP,
        "CLI choices": _linear_backend_field().type,
    }


def _op_body():
    """The Python function behind vLLM's ``flashinfer_mm_fp4``: the torch.library op's own in
    0.33; from 0.34 the one its eager wrapper calls."""
    op = vllm_flashinfer.flashinfer_mm_fp4
    return getattr(op, "_init_fn", None) or vllm_flashinfer._flashinfer_mm_fp4


def _linear_backend_field():
    from vllm.config.kernel import KernelConfig

    return KernelConfig.__dataclass_fields__["linear_backend"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Each test starts unpatched, with vLLM's loader ready to run again, and ends unpatched."""
    before = _objects()
    monkeypatch.delenv(_common.ENABLE_ENV, raising=False)
    monkeypatch.delenv(_common.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    monkeypatch.setattr(_common, "_warned_untested", set())
    yield
    integration.unpatch()
    monkeypatch.undo()  # a test's own stand-ins go first, then everything must be as it was
    assert _objects() == before


@pytest.fixture(scope="module")
def cpu_op():
    """vLLM's op, callable on the CPU: in 0.33 its body is registered as its CPU kernel once per
    process; from 0.34 an eager call runs the body without the dispatcher."""
    op = vllm_flashinfer.flashinfer_mm_fp4
    if hasattr(op, "register_kernel") and "cpu" not in op._backend_fns:
        op.register_kernel("cpu")(op._init_fn)
    return op


# -- the facts the plugin stands on ------------------------------------------------------------
def test_vllm_version_and_patch_targets_are_what_the_plugin_expects():
    assert integration.engine_version() in integration.TESTED_VERSIONS
    assert vllm_plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    # The custom op imports flashinfer.mm_fp4 inside its body, on every call.
    body = _op_body()
    assert "from flashinfer import mm_fp4" in inspect.getsource(body)
    assert list(inspect.signature(body).parameters) == [
        "A",
        "B",
        "A_scale",
        "B_scale",
        "g_scale",
        "dtype",
        "use_8x4_sf_layout",
        "backend",
        "block_size",
        "use_nvfp4",
    ]
    source = inspect.getsource(vllm_flashinfer.flashinfer_scaled_fp4_mm)
    assert 'backend == "trtllm" and a.shape[0] <= 32' in source  # 8x4 scales at small M
    # Each FlashInfer NVFP4 kernel class exists and passes the backend the plugin maps.
    for name, backend in integration.KERNEL_BACKENDS.items():
        cls = getattr(vllm_kernels, name)
        assert cls.__module__ == integration.KERNEL_MODULE
        assert f'backend="{backend}"' in inspect.getsource(cls.apply_weights), name
        assert backend in _common.LAYOUT_OF_BACKEND
    trtllm_prep = inspect.getsource(vllm_kernels.FlashInferTrtllmNvFp4LinearKernel)
    assert "shuffle_matrix_a" in trtllm_prep
    # The load-time hook point comes before memory profiling, and has what tune_worker reads.
    assert callable(Worker.load_model) and callable(Worker.determine_available_memory)
    from vllm.config import SchedulerConfig
    from vllm.v1.worker.worker_base import WorkerBase

    init = inspect.getsource(WorkerBase.__init__)
    assert "self.vllm_config = vllm_config" in init
    assert "self.model_config = vllm_config.model_config" in init
    # Its model runner: gpu_model_runner's by default in 0.33, gpu.model_runner's (the only one
    # from 0.34, where the other module is gone) with use_v2_model_runner.
    runners = [
        importlib.import_module(name).GPUModelRunner
        for name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
        if importlib.util.find_spec(name) is not None
    ]
    assert runners and all(callable(runner.get_model) for runner in runners)
    assert "max_num_batched_tokens" in SchedulerConfig.__dataclass_fields__
    # Where model_shapes finds each layer's kernel: quant_method.kernel (ModelOpt) and
    # scheme.kernel (compressed-tensors).
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        compressed_tensors as ct_method,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as ct_w4a4,
    )

    assert "self.kernel = select_linear_kernel(" in inspect.getsource(modelopt.ModelOptLinearMethod)
    assert "self.kernel = init_nvfp4_linear_kernel(" in inspect.getsource(
        ct_w4a4.CompressedTensorsW4A4Fp4
    )
    assert "layer.scheme = " in inspect.getsource(ct_method)


# -- vllm's own loader -------------------------------------------------------------------------
def test_vllm_loader_finds_and_applies_the_plugin(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "fp4select")
    vllm_plugins.load_general_plugins()
    assert getattr(flashinfer.mm_fp4, "__fp4select__", False)
    assert integration.is_patched()
    assert vars(Worker)["load_model"].__wrapped__ is not None
    # The custom op is not replaced, and fp4select's backend still finds flashinfer's kernel.
    assert vllm_flashinfer.flashinfer_mm_fp4 is _objects()["vllm op"]
    assert not getattr(gemm_base.mm_fp4, "__fp4select__", False)
    assert fi_backend.load()[0] is gemm_base.mm_fp4


@pytest.mark.parametrize("allow_list", [None, "", "lora_filesystem_resolver"])
def test_vllm_loader_leaves_vllm_alone_unless_the_allow_list_names_fp4select(
    monkeypatch, allow_list
):
    if allow_list is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allow_list)
    before = _objects()
    vllm_plugins.load_general_plugins()
    assert _objects() == before


# -- a call through vLLM's FlashInfer NVFP4 path ----------------------------------------------------
@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "cudnn", "cute-dsl", "b12x"])
@pytest.mark.parametrize("m", [3, 40])
def test_flashinfer_scaled_fp4_mm_reaches_best_mm_fp4_within_the_prepared_layout(
    inprocess, cpu_op, backend, m
):
    register_layout_backends()
    assert integration.patch(tune_at_load=False)
    layout = _common.LAYOUT_OF_BACKEND[backend]
    # vLLM's trtllm activations carry 8x4 scales at M <= 32.
    problem = problem_for(layout, m, eight_by_four=layout == "trtllm" and m <= 32)
    inputs = make_inputs(problem, m, "cpu")
    # As vLLM's kernels call it: the (N, K/2) weight and its (N, K/16) scale rows.
    out = vllm_flashinfer.flashinfer_scaled_fp4_mm(
        inputs.a,
        inputs.b.T,
        inputs.a_descale,
        inputs.b_descale.T,
        inputs.alpha,
        torch.bfloat16,
        backend=backend,
    )
    assert_exact(out, inputs, problem)
    allowed, other = (
        (SHUFFLED_ONLY, PLAIN_ONLY) if layout == "trtllm" else (PLAIN_ONLY, SHUFFLED_ONLY)
    )
    assert_family(problem, allowed, other)
    assert other not in calls
    assert fp4select.stats()["tunings"] == 1


def test_without_the_plugin_the_call_reaches_flashinfer(cpu_op):
    # The control for the test above: unpatched, the same call is flashinfer's (no CUDA here).
    problem = problem_for("plain", 3)
    inputs = make_inputs(problem, 3, "cpu")
    with pytest.raises(Exception) as info:
        vllm_flashinfer.flashinfer_scaled_fp4_mm(
            inputs.a,
            inputs.b.T,
            inputs.a_descale,
            inputs.b_descale.T,
            inputs.alpha,
            torch.bfloat16,
            backend="cutlass",
        )
    assert "fp4select" not in str(info.value)


# -- unpatch and the version gate --------------------------------------------------------------
def test_unpatch_restores_every_object():
    before = _objects()
    assert integration.patch(tune_at_load=True)
    after = _objects()
    assert after["flashinfer.mm_fp4"] is not before["flashinfer.mm_fp4"]
    assert after["Worker.load_model"] is not before["Worker.load_model"]
    assert after["gemm_base.mm_fp4"] is before["gemm_base.mm_fp4"]
    assert after["NVFP4 kernels"] is not before["NVFP4 kernels"]
    assert "fp4select" in typing.get_args(after["CLI choices"])
    assert integration.patch() is True  # idempotent
    assert len(integration.unpatch()) == 5  # mm_fp4, kernel list, backend map, CLI, load_model
    assert _objects() == before
    assert integration.unpatch() == []


def test_an_untested_vllm_logs_one_warning_and_is_left_untouched(monkeypatch, caplog):
    monkeypatch.setattr(integration, "engine_version", lambda: "0.99.0")
    monkeypatch.setenv("VLLM_PLUGINS", "fp4select")
    before = _objects()
    with caplog.at_level(logging.WARNING, logger="fp4select.integrations"):
        vllm_plugins.load_general_plugins()
        integration.plugin()
        assert integration.patch() is False
    assert _objects() == before
    warnings = [r.getMessage() for r in caplog.records if r.name == "fp4select.integrations"]
    assert len(warnings) == 1, warnings
    assert "vLLM 0.99.0 is not a version" in warnings[0] and "0.34.0" in warnings[0]


# -- tuning at load ------------------------------------------------------------------------------
def _fp4_layer(kernel_class: type, n: int, k: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.quant_method = types.SimpleNamespace(kernel=object.__new__(kernel_class))
    layer.weight = torch.nn.Parameter(
        torch.zeros(n, k // 2, dtype=torch.uint8), requires_grad=False
    )
    return layer


def test_worker_load_model_tunes_the_loaded_fp4_layers(inprocess, monkeypatch, caplog):
    register_layout_backends()
    loaded = []
    monkeypatch.setattr(Worker, "load_model", lambda self: loaded.append(self))
    assert integration.patch(tune_at_load=True)
    model = torch.nn.Sequential(
        _fp4_layer(vllm_kernels.FlashInferTrtllmNvFp4LinearKernel, 256, 128),
        _fp4_layer(vllm_kernels.FlashInferCutlassNvFp4LinearKernel, 384, 128),
        torch.nn.Linear(4, 4),  # not FP4: ignored
    )
    worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(get_model=lambda: model),
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2)
        ),
    )
    with caplog.at_level(logging.INFO, logger="fp4select.integrations"):
        Worker.load_model(worker)
    assert loaded == [worker]
    # Two layers, buckets 1 and 2: four problems; the trtllm layer's with 8x4 scales.
    assert fp4select.stats()["tunings"] == 4
    assert "[4/4]" in caplog.text and "sandbox worker closed" in caplog.text
    assert_family(problem_for("trtllm", 2, eight_by_four=True), SHUFFLED_ONLY, PLAIN_ONLY)
    assert_family(problem_for("plain", 2, n=384), PLAIN_ONLY, SHUFFLED_ONLY)


def test_the_vllm_example_check_runs(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "vllm_fp4select.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FP4SELECT_"))}
    env["FP4SELECT_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "is fp4select's: True" in proc.stdout


# -- SM80-SM90: fp4select's W4A4 kernel in vLLM's list ------------------------------------------
@pytest.fixture
def sm90(monkeypatch):
    """vLLM's platform reports a CUDA GPU of compute capability 9.0 (this machine has none);
    the TP group is one rank. Each kernel class asks the platform as it would on an H100."""
    from vllm.model_executor import parameter
    from vllm.model_executor.layers.quantization.utils import nvfp4_utils
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    cap = DeviceCapability(9, 0)

    def has(c, device_id=0):
        return cap.to_int() >= (c if isinstance(c, int) else c[0] * 10 + c[1])

    monkeypatch.setattr(current_platform, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: cap)
    monkeypatch.setattr(current_platform, "has_device_capability", has)
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda c, device_id=0: c // 10 == 9
    )
    # vLLM's CUTLASS FP4 support check asks its compiled extension, absent here: SM100+.
    monkeypatch.setattr(nvfp4_utils, "cutlass_scaled_mm_supports_fp4", lambda cc: cc >= 100)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    return cap


def _linear_backend(monkeypatch, name: str) -> None:
    """--linear-backend NAME, set as vLLM's create_engine_config sets it on KernelConfig."""
    import vllm.config
    from vllm.config.kernel import KernelConfig

    kernel_config = KernelConfig()
    kernel_config.linear_backend = name
    current = types.SimpleNamespace(kernel_config=kernel_config)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)


def _chosen() -> str:
    return type(vllm_linear.init_nvfp4_linear_kernel()).__name__


def test_on_sm90_vllm_picks_fp4selects_w4a4_kernel_ahead_of_marlin(sm90):
    assert _chosen() == "MarlinNvFp4LinearKernel"  # vLLM's own choice: weight-only
    assert integration.patch(tune_at_load=False)
    assert _chosen() == integration.KERNEL_NAME
    order = [k.__name__ for k in vllm_linear._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]]
    assert order.index(integration.KERNEL_NAME) < order.index("MarlinNvFp4LinearKernel")
    assert integration.unpatch()
    assert _chosen() == "MarlinNvFp4LinearKernel"  # unpatched: the Marlin path again


def test_linear_backend_marlin_keeps_marlin_and_fp4select_is_chosen_by_name(sm90, monkeypatch):
    assert integration.patch(tune_at_load=False)
    _linear_backend(monkeypatch, "marlin")
    assert _chosen() == "MarlinNvFp4LinearKernel"
    _linear_backend(monkeypatch, "fp4select")
    assert _chosen() == integration.KERNEL_NAME
    # By name it serves Blackwell too; unnamed, vLLM's own kernels keep SM100+.
    assert integration.kernel_supported(100) == (True, None)
    _linear_backend(monkeypatch, "auto")
    supported, why = integration.kernel_supported(100)
    assert not supported and "--linear-backend fp4select" in why
    assert integration.kernel_supported(75)[0] is False


def test_the_cli_takes_linear_backend_fp4select_only_while_patched(sm90):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse():
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        return parser.parse_args(["--linear-backend", "fp4select"]).linear_backend

    with pytest.raises(SystemExit):
        parse()
    assert integration.patch(tune_at_load=False)
    assert parse() == "fp4select"
    integration.unpatch()
    with pytest.raises(SystemExit):
        parse()


@pytest.mark.parametrize("n", [256, 240])
def test_a_modelopt_nvfp4_layer_on_sm90_returns_the_exact_w4a4_product(inprocess, sm90, n):
    from test_integrations_common import expected_w4a4, layer_operands
    from vllm.model_executor.layers.quantization import modelopt

    assert integration.patch(tune_at_load=False)
    ops = layer_operands(n, 128)
    method = modelopt.build_linear_method(types.SimpleNamespace(group_size=16), "NVFP4", "l")
    layer = torch.nn.Module()
    layer.quant_method = method  # as vLLM's LinearBase holds it
    half = n // 2
    method.create_weights(
        layer, 128, [half, n - half], 128, n, torch.bfloat16, weight_loader=lambda *a: None
    )
    assert type(method.kernel).__name__ == integration.KERNEL_NAME
    layer.weight.data.copy_(ops.weight)
    layer.weight_scale.data.copy_(ops.weight_scale)
    layer.weight_scale_2.data.fill_(float(ops.weight_scale_2))
    layer.input_scale.data.fill_(float(ops.input_scale))
    method.process_weights_after_loading(layer)
    out = method.apply(layer, ops.x)
    assert torch.equal(out, expected_w4a4(ops))
    assert fp4select.stats()["tunings"] == 1
    # Tuning at load finds fp4select's own layers too (the plain layout).
    shapes, _ = integration.model_shapes(torch.nn.Sequential(layer), "bfloat16")
    assert shapes == [_common.LinearShape(n, 128, "bfloat16", "plain")]
