"""The SGLang plugin against the real SGLang package, on the CPU.

Run by .ci/engines.sh in an environment with sglang 0.5.23 installed without its GPU
dependencies; skipped elsewhere. SGLang's ``fp4_gemm`` custom op is registered for CUDA only,
so calls go through its Python body, ``fp4_gemm.__wrapped__``, which looks up
``flashinfer_fp4_gemm`` at call time exactly as the op does on a GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here (.ci/engines.sh builds the engine test environment)",
        allow_module_level=True,
    )

import flashinfer
import flashinfer.gemm.gemm_base as gemm_base
from sglang.srt import plugins as sglang_plugins
from sglang.srt.layers.quantization import fp4_utils
from sglang.srt.layers.quantization import modelopt_quant as mq
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from test_integrations_common import (
    PLAIN_ONLY,
    SHUFFLED_ONLY,
    assert_exact,
    assert_family,
    calls,
    problem_for,
    register_layout_backends,
)

import fp4select
from fp4select.backends import flashinfer as fi_backend
from fp4select.integrations import _common
from fp4select.integrations import sglang as integration
from fp4select.validate import make_inputs

pytestmark = pytest.mark.engines

Backend = fp4_utils.Fp4GemmRunnerBackend
LAYOUT_OF_RUNNER = {
    Backend.FLASHINFER_TRTLLM: "trtllm",
    Backend.FLASHINFER_CUTLASS: "plain",
    Backend.FLASHINFER_CUDNN: "plain",
    Backend.FLASHINFER_CUTEDSL: "plain",
}


def _objects() -> dict[str, object]:
    """Every object the plugin may change, by identity."""
    return {
        "modelopt_quant.flashinfer_fp4_gemm": mq.flashinfer_fp4_gemm,
        "modelopt_quant.fp4_quantize": mq.fp4_quantize,
        "modelopt_quant.get_platform": mq.get_platform,
        "process_weights_after_loading": vars(mq.ModelOptFp4LinearMethod)[
            "process_weights_after_loading"
        ],
        "fp4_utils.initialize_fp4_gemm_config": fp4_utils.initialize_fp4_gemm_config,
        "ModelRunner.initialize": vars(ModelRunner)["initialize"],
        "flashinfer.mm_fp4": flashinfer.mm_fp4,
        "gemm_base.mm_fp4": gemm_base.mm_fp4,
    }


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Each test starts unpatched, with SGLang's loader ready to run again, and ends unpatched."""
    before = _objects()
    monkeypatch.delenv(_common.ENABLE_ENV, raising=False)
    monkeypatch.delenv(_common.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.setattr(_common, "_warned_untested", set())
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", None)
    yield
    integration.unpatch()
    HookRegistry.reset()
    monkeypatch.undo()  # a test's own stand-ins go first, then everything must be as it was
    assert _objects() == before


# -- the facts the plugin stands on ------------------------------------------------------------
def test_sglang_version_and_patch_targets_are_what_the_plugin_expects():
    assert integration.engine_version() in integration.TESTED_VERSIONS
    # The call site's name is flashinfer's function, bound at import.
    assert mq.enable_flashinfer_fp4_gemm is True
    assert mq.flashinfer_fp4_gemm is flashinfer.mm_fp4 is gemm_base.mm_fp4
    params = list(inspect.signature(mq.flashinfer_fp4_gemm).parameters)
    assert params[:12] == [
        "a",
        "b",
        "a_descale",
        "b_descale",
        "alpha",
        "out_dtype",
        "out",
        "block_size",
        "use_8x4_sf_layout",
        "backend",
        "use_nvfp4",
        "enable_pdl",
    ]
    # fp4_gemm's body (the custom op's Python function) reads the global by name at call time.
    body = mq.fp4_gemm.__wrapped__
    assert list(inspect.signature(body).parameters) == [
        "input",
        "weight",
        "input_sf",
        "weight_sf",
        "alpha",
        "out_dtype",
        "out_features",
        "quant_mode",
    ]
    assert "flashinfer_fp4_gemm" in body.__code__.co_names
    # Every flashinfer runner backend maps to a layout family; marlin never calls mm_fp4.
    for member in Backend:
        if member.is_marlin():
            continue
        name = member.get_flashinfer_backend()
        assert name in _common.LAYOUT_OF_BACKEND, name
        if member in LAYOUT_OF_RUNNER:
            assert _common.LAYOUT_OF_BACKEND[name] == LAYOUT_OF_RUNNER[member]
    # The load-time hook point and the server arguments the M bound is read from.
    assert "self.load_model()" in inspect.getsource(ModelRunner.initialize)
    runner_source = inspect.getsource(ModelRunner)
    for needed in ("self.server_args = server_args", "self.model_config", "self.model = "):
        assert needed in runner_source, needed
    from sglang.srt.server_args import ServerArgs

    fields = set(dir(ServerArgs))
    for name in (
        "cuda_graph_max_bs_decode",
        "max_running_requests",
        "speculative_num_draft_tokens",
        "chunked_prefill_size",
        "max_prefill_tokens",
    ):
        assert name in fields, name
    assert sglang_plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"


# -- sglang's own loader -------------------------------------------------------------------------
def test_sglang_loader_finds_and_applies_the_plugin(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "fp4select")
    sglang_plugins.load_plugins()
    assert getattr(mq.flashinfer_fp4_gemm, "__fp4select__", False)
    assert integration.is_patched()
    assert vars(ModelRunner)["initialize"].__wrapped__ is not None
    # flashinfer's own names are untouched, and fp4select's backend still finds the kernel.
    assert flashinfer.mm_fp4 is gemm_base.mm_fp4
    assert not getattr(flashinfer.mm_fp4, "__fp4select__", False)
    assert fi_backend.load()[0] is gemm_base.mm_fp4


@pytest.mark.parametrize("allow_list", [None, "", "some_other_plugin"])
def test_sglang_loader_leaves_sglang_alone_unless_the_allow_list_names_fp4select(
    monkeypatch, allow_list
):
    if allow_list is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", allow_list)
    before = _objects()
    sglang_plugins.load_plugins()
    assert _objects() == before


def test_a_hookregistry_replace_of_flashinfer_cannot_divert_fp4selects_kernel(monkeypatch):
    # Another plugin REPLACEs flashinfer.mm_fp4: SGLang rebinds every module global that `is`
    # the original (gemm_base's too). Ours is a different object and fp4select pinned the
    # real kernel when it patched, so neither is diverted.
    monkeypatch.setenv("SGLANG_PLUGINS", "fp4select,other")
    real = gemm_base.mm_fp4
    monkeypatch.setattr(
        sglang_plugins,
        "load_plugins_by_group",
        lambda group, excluded_dists=None: {
            "fp4select": (integration.plugin, "fp4select"),
            "other": (
                lambda: HookRegistry.register(
                    "flashinfer.mm_fp4", lambda *a, **k: "other", HookType.REPLACE
                ),
                "other",
            ),
        },
    )
    try:
        sglang_plugins.load_plugins()
        assert gemm_base.mm_fp4 is not real  # the REPLACE did reach flashinfer's globals
        assert getattr(mq.flashinfer_fp4_gemm, "__fp4select__", False)
        assert fi_backend.load()[0] is real
    finally:
        replaced = gemm_base.mm_fp4
        if replaced is not real:
            for module in list(sys.modules.values()):
                if isinstance(module, types.ModuleType):
                    for name, value in list(vars(module).items()):
                        if value is replaced:
                            setattr(module, name, real)


# -- a call through fp4_gemm -----------------------------------------------------------------------
@pytest.mark.parametrize("runner_backend", list(LAYOUT_OF_RUNNER), ids=lambda b: b.value)
@pytest.mark.parametrize("m", [1, 37])
def test_fp4_gemm_reaches_best_mm_fp4_within_the_prepared_layout(
    inprocess, monkeypatch, runner_backend, m
):
    register_layout_backends()
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", runner_backend)
    assert integration.patch(tune_at_load=False)
    layout = LAYOUT_OF_RUNNER[runner_backend]
    problem = problem_for(layout, m)
    inputs = make_inputs(problem, m, "cpu")
    # As ModelOptFp4LinearMethod.apply calls it: weight.T and the weight scales' .T.
    out = mq.fp4_gemm.__wrapped__(
        inputs.a,
        inputs.b,
        inputs.a_descale,
        inputs.b_descale,
        inputs.alpha,
        torch.bfloat16,
        problem.n,
    )
    assert_exact(out, inputs, problem)
    allowed, other = (
        (SHUFFLED_ONLY, PLAIN_ONLY) if layout == "trtllm" else (PLAIN_ONLY, SHUFFLED_ONLY)
    )
    record = assert_family(problem, allowed, other)
    assert record["winner"] in (allowed, "emulation")
    assert other not in calls
    assert fp4select.stats()["tunings"] == 1


def test_marlin_is_left_alone(monkeypatch):
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", Backend.MARLIN)
    assert integration.current_layout() is None


# -- unpatch and the version gate --------------------------------------------------------------
def test_unpatch_restores_every_object():
    before = _objects()
    assert integration.patch(tune_at_load=True)
    after = _objects()
    assert (
        after["modelopt_quant.flashinfer_fp4_gemm"]
        is not before["modelopt_quant.flashinfer_fp4_gemm"]
    )
    assert after["ModelRunner.initialize"] is not before["ModelRunner.initialize"]
    assert integration.patch() is True  # idempotent: nothing patched twice
    restored = integration.unpatch()
    # flashinfer_fp4_gemm, the two initialize_fp4_gemm_config bindings (scheduler's when it is
    # imported), the gated process_weights_after_loading, fp4_quantize and ModelRunner.initialize
    assert len(restored) == (6 if "sglang.srt.managers.scheduler" in sys.modules else 5)
    assert _objects() == before
    assert integration.unpatch() == []


def test_an_untested_sglang_logs_one_warning_and_is_left_untouched(monkeypatch, caplog):
    monkeypatch.setattr(integration, "engine_version", lambda: "0.5.99")
    monkeypatch.setenv("SGLANG_PLUGINS", "fp4select")
    before = _objects()
    with caplog.at_level(logging.WARNING, logger="fp4select.integrations"):
        sglang_plugins.load_plugins()
        integration.plugin()
        assert integration.patch() is False
    assert _objects() == before
    warnings = [r.getMessage() for r in caplog.records if r.name == "fp4select.integrations"]
    assert len(warnings) == 1, warnings
    assert "SGLang 0.5.99 is not a version" in warnings[0] and "0.5.23" in warnings[0]


# -- tuning at load ------------------------------------------------------------------------------
def _fp4_layer(n: int, k: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    method = object.__new__(mq.ModelOptFp4LinearMethod)  # no config needed to be recognised
    method.quant_mode = "w4a4"
    layer.quant_method = method
    layer.weight = torch.nn.Parameter(
        torch.zeros(n, k // 2, dtype=torch.uint8), requires_grad=False
    )
    return layer


def test_model_runner_initialize_tunes_the_loaded_fp4_layers(inprocess, monkeypatch, caplog):
    register_layout_backends()
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", Backend.FLASHINFER_TRTLLM)
    loaded = []
    monkeypatch.setattr(ModelRunner, "initialize", lambda self: loaded.append(self))
    assert integration.patch(tune_at_load=True)
    model = torch.nn.Sequential(_fp4_layer(256, 128), _fp4_layer(256, 128), _fp4_layer(384, 256))
    model.append(torch.nn.Linear(4, 4))  # not FP4: ignored
    server_args = types.SimpleNamespace(
        cuda_graph_max_bs_decode=2,
        max_running_requests=None,
        speculative_num_draft_tokens=2,
        chunked_prefill_size=3,
        max_prefill_tokens=16384,
    )
    runner = types.SimpleNamespace(
        model=model,
        server_args=server_args,
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
    )
    with caplog.at_level(logging.INFO, logger="fp4select.integrations"):
        ModelRunner.initialize(runner)
    assert loaded == [runner]
    # Two distinct (N, K); M up to max(2 x 2, 3) = 4, buckets 1, 2, 4: six problems, all in
    # the trtllm family.
    assert fp4select.stats()["tunings"] == 6
    assert "[6/6]" in caplog.text and "sandbox worker closed" in caplog.text
    assert_family(problem_for("trtllm", 3, n=384, k=256), SHUFFLED_ONLY, PLAIN_ONLY)


def test_server_max_m_takes_the_larger_of_decode_and_prefill():
    args = types.SimpleNamespace(
        cuda_graph_max_bs_decode=256,
        speculative_num_draft_tokens=4,
        chunked_prefill_size=-1,
        max_prefill_tokens=512,
    )
    assert integration.server_max_m(args) == 1024
    args.chunked_prefill_size = 8192
    assert integration.server_max_m(args) == 8192


def test_the_sglang_example_check_runs(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "sglang_fp4select.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FP4SELECT_"))}
    env["FP4SELECT_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "SGLang's FP4 GEMM is fp4select's: True" in proc.stdout
    assert "flashinfer.mm_fp4 untouched: True" in proc.stdout


_SCHEDULER_PROCESS = """
import sys
{imports}
from sglang.srt.plugins import load_plugins

load_plugins()
mq = sys.modules.get("sglang.srt.layers.quantization.modelopt_quant")
print("imported:", mq is not None)
print("patched:", bool(mq and getattr(mq.flashinfer_fp4_gemm, "__fp4select__", False)))
"""


@pytest.mark.parametrize(
    "imports, expected",
    [
        # SGLang's scheduler process: scheduler.py is imported, then load_plugins() runs.
        ("import sglang.srt.managers.scheduler", "imported: True\npatched: True"),
        # A process that runs no GEMM (detokenizer, HTTP server): left as it was.
        ("", "imported: False\npatched: False"),
    ],
    ids=["scheduler", "other"],
)
def test_the_plugin_patches_the_process_that_runs_the_gemms(tmp_path, imports, expected):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FP4SELECT_"))}
    env.update(SGLANG_PLUGINS="fp4select", FP4SELECT_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", _SCHEDULER_PROCESS.format(imports=imports)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout


# -- SM80-SM90: the ModelOpt NVFP4 dense path through fp4select ------------------------------
_CPU_GEMM = None


@pytest.fixture
def sm90(monkeypatch):
    """SGLang reads a CUDA GPU of compute capability 9.0 (this machine has none) and the
    server's --fp4-gemm-backend from ``configured`` (set the returned namespace's field).

    Stand-ins for what only a GPU process has: the published server config, ``.cuda()``
    (SGLang's plain weight preparation moves the swizzled scales with it) and a CPU kernel for
    the ``sglang::fp4_gemm`` op (its own Python body, as on a GPU).
    """
    global _CPU_GEMM
    configured = types.SimpleNamespace(fp4_gemm_runner_backend="auto")
    monkeypatch.setattr(fp4_utils, "get_exec", lambda: types.SimpleNamespace(kernel=configured))
    monkeypatch.setattr(fp4_utils, "get_device_capability", lambda device_id=0: (9, 0))
    monkeypatch.setattr(fp4_utils, "is_cuda", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    if _CPU_GEMM is None:
        _CPU_GEMM = torch.library.Library("sglang", "IMPL")
        _CPU_GEMM.impl("fp4_gemm", mq.fp4_gemm.__wrapped__, "CPU")
    return configured


def _sglang_layer(n: int, k: int):
    from test_integrations_common import layer_operands

    ops = layer_operands(n, k)
    config = types.SimpleNamespace(is_checkpoint_nvfp4_serialized=True, group_size=16, is_awq=False)
    method = mq.ModelOptFp4LinearMethod(config)
    layer = torch.nn.Module()
    half = n // 2
    method.create_weights(
        layer, k, [half, n - half], k, n, torch.bfloat16, weight_loader=lambda *a: None
    )
    layer.weight.data.copy_(ops.weight)
    layer.weight_scale.data.copy_(ops.weight_scale)
    layer.weight_scale_2.data.fill_(float(ops.weight_scale_2))
    layer.input_scale.data.fill_(float(ops.input_scale))
    return method, layer, ops


def test_on_sm90_auto_serves_through_fp4select_and_marlin_stays_when_named(sm90):
    fp4_utils.initialize_fp4_gemm_config()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.MARLIN  # SGLang's own choice
    assert integration.patch(tune_at_load=False)
    fp4_utils.initialize_fp4_gemm_config()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.FLASHINFER_CUTLASS
    sm90.fp4_gemm_runner_backend = "marlin"  # --fp4-gemm-backend marlin
    fp4_utils.initialize_fp4_gemm_config()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.MARLIN


# N = 240: SGLang pads the weight to 256 rows for its kernels and slices the output back.
@pytest.mark.parametrize("n", [256, 240])
def test_a_modelopt_nvfp4_layer_on_sm90_returns_the_exact_w4a4_product(inprocess, sm90, n):
    from test_integrations_common import expected_w4a4

    assert integration.patch(tune_at_load=False)
    fp4_utils.initialize_fp4_gemm_config()
    method, layer, ops = _sglang_layer(n, 128)
    method.process_weights_after_loading(layer)  # the SM100 gate, lifted for this call only
    assert mq.get_platform().is_blackwell is False
    out = method.apply(layer, ops.x)
    assert out.shape == (5, n)
    assert torch.equal(out, expected_w4a4(ops))
    assert fp4select.stats()["tunings"] == 1


def test_unpatch_restores_the_gate_the_quantizer_and_marlin(sm90):
    original_quantize = mq.fp4_quantize
    assert integration.patch(tune_at_load=False)
    assert getattr(mq.fp4_quantize, "__fp4select__", False)
    fp4_utils.initialize_fp4_gemm_config()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.FLASHINFER_CUTLASS
    integration.unpatch()
    assert mq.fp4_quantize is original_quantize
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.MARLIN  # what SGLang had chosen
    fp4_utils.initialize_fp4_gemm_config()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is Backend.MARLIN
    # A named FlashInfer backend raises SGLang's own message again.
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = Backend.FLASHINFER_CUTLASS
    method, layer, _ = _sglang_layer(256, 128)
    with pytest.raises(ValueError, match="require SM100"):
        method.process_weights_after_loading(layer)


def test_the_quantizer_stand_in_refuses_what_it_does_not_make(sm90):
    assert integration.patch(tune_at_load=False)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    packed, scales = mq.fp4_quantize(x, torch.tensor([1.0]))
    assert packed.shape == (3, 16) and scales.dtype == torch.uint8 and scales.shape == (128, 4)
    with pytest.raises(NotImplementedError, match="128x4"):
        mq.fp4_quantize(x, torch.tensor([1.0]), is_sf_8x4_layout=True)
