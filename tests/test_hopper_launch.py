"""The warm path's plans for the ``hopper-*`` paths (``hopper_launch``, ``triton_hopper``): what a
plan's key tells apart, that a plan is made once per key, and that it keeps no caller tensor.

The compiled launches themselves run on a GPU only (``tests/test_hopper_kernels_gpu.py``);
the interpreter's tests run the planned runners twice with other values
(``tests/test_hopper_interpret.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import weakref

import pytest
import torch

from fp4select import validate
from fp4select.backends import hopper_configs as hc
from fp4select.backends import hopper_launch, triton_fp4, triton_hopper
from fp4select.keys import Problem, m_bucket

pytestmark = pytest.mark.skipif(
    not triton_fp4.triton_installed(), reason="the plans name Triton kernels"
)


def _args(m: int = 4, n: int = 64, k: int = 128, seed: int = 1, **problem: str) -> tuple:
    p = Problem(n=n, k=k, m_bucket=m_bucket(m), **problem)
    return validate.make_inputs(p, m, "cpu", seed=seed, with_reference=False).args(p)


@pytest.fixture(
    params=["python", pytest.param("native", marks=[pytest.mark.slow, pytest.mark.subprocess])]
)
def key_form(request):
    """Plans keyed in Python, or by the warm path's C++ key (as ``configure`` hands it down)."""
    from fp4select import native_key

    key = None
    if request.param == "native":
        key = native_key.load(request.getfixturevalue("native_dir"))
        assert key is not None
    hopper_launch.use_native_key(key)
    yield request.param
    hopper_launch.use_native_key(None)


def test_calls_that_differ_only_in_values_share_a_key(key_form):
    assert hopper_launch.call_key(_args(seed=1)) == hopper_launch.call_key(_args(seed=2))


@pytest.mark.parametrize(
    "change",
    [
        "m",
        "alpha none",
        "alpha number",
        "out given",
        "out strided",
        "a misaligned",
        "pdl off",
        "8x4 scales",
    ],
)
def test_a_key_tells_apart_what_a_plan_depends_on(change, key_form):
    base = _args(m=4, alpha_kind="scalar")
    args = list(base)
    if change == "m":
        args = list(_args(m=3, alpha_kind="scalar"))
    elif change == "alpha none":
        args[4] = None
    elif change == "alpha number":
        args[4] = 0.5
    elif change == "out given":
        args[6] = torch.empty((4, 64), dtype=torch.bfloat16)
    elif change == "out strided":
        args[6] = torch.empty((64, 4), dtype=torch.bfloat16).T
    elif change == "a misaligned":  # the same shape and strides, 8 bytes into a buffer
        buffer = torch.zeros(base[0].numel() + 8, dtype=torch.uint8)
        args[0] = buffer[8:].view(base[0].shape)
        assert args[0].shape == base[0].shape and args[0].stride() == base[0].stride()
    elif change == "pdl off":
        args[10] = False
    elif change == "8x4 scales":
        args = list(_args(m=4, alpha_kind="scalar", a_sf_layout="8x4"))
    assert hopper_launch.call_key(tuple(args)) != hopper_launch.call_key(base)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_settings_hand_the_c_key_to_the_plans(native_dir, cache_dir):
    import fp4select

    fp4select.configure(cache_dir=cache_dir, native="auto", native_dir=native_dir)
    assert hopper_launch._native is not None
    assert isinstance(hopper_launch.call_key(_args())[0][0], int)  # the C++ key's interned int
    fp4select.configure(cache_dir=cache_dir, native="off")
    assert hopper_launch._native is None


def test_a_call_that_is_not_tensors_has_no_key(key_form):
    args = list(_args())
    args[0] = [[0]]
    assert hopper_launch.call_key(tuple(args)) is None


def test_a_plan_is_made_once_per_key_and_each_call_runs_it():
    hopper_launch.clear_plans()
    made: list[int] = []
    ran: list[int] = []

    def plan_for(args: tuple, cfg: object):
        made.append(args[0].shape[0])
        return lambda call: ran.append(call[0].shape[0]) or call[0]

    for m in (4, 4, 3, 4, 3):
        hopper_launch.planned("test", plan_for, _args(m=m, seed=m), None)
    assert made == [4, 3]
    assert ran == [4, 4, 3, 4, 3]
    hopper_launch.planned("test", plan_for, _args(m=4), hc.GemvConfig(2, 4, 1))  # another cfg
    assert made == [4, 3, 4]
    hopper_launch.clear_plans()


def test_the_table_starts_again_when_full(monkeypatch):
    hopper_launch.clear_plans()
    monkeypatch.setattr(hopper_launch, "MAX_PLANS", 2)
    made: list[int] = []

    def plan_for(args: tuple, cfg: object):
        made.append(1)
        return lambda call: call[0]

    for m in (1, 2, 3, 1):
        hopper_launch.planned("test", plan_for, _args(m=m), None)
    assert len(made) == 4  # the third plan cleared the table, so the first was made again
    assert len(hopper_launch._plans) == 2
    hopper_launch.clear_plans()


@pytest.mark.parametrize(
    ("plan_for", "cfg", "m"),
    [
        (triton_hopper._gemv_plan, hc.GemvConfig(2, 4, 1, pre=1), 3),
        (triton_hopper._mma_plan, hc.MmaConfig(16, 16, 16, 1, 1, 2), 5),
    ],
)
def test_a_plan_keeps_no_tensor_of_the_call_it_was_made_from(plan_for, cfg, m):
    args = _args(m=m, n=40, k=512, alpha_kind="per_token")
    refs = [weakref.ref(t) for t in args if isinstance(t, torch.Tensor)]
    plan = plan_for(args, cfg)  # planning launches nothing: it runs on the CPU
    del args
    gc.collect()
    assert callable(plan)
    assert [r() for r in refs] == [None] * len(refs)


def test_the_warm_path_binds_the_planned_runners_at_the_records_tactic():
    th = triton_hopper
    problem = Problem(n=4096, k=4096, m_bucket=m_bucket(16))
    backends = {b.name: b for b in th.BACKENDS}
    cases = [
        ("hopper-gemv", th.fast_gemv, hc.candidates("gemv", 1)[1]),
        ("hopper-mma", th.fast_mma, hc.candidates("mma", 16)[1]),
        ("hopper-ws", th.fast_ws, hc.candidates("ws", 128)[1]),
    ]
    for name, fast, cfg in cases:
        record = {"op": "hopper", "tactic": list(dataclasses.astuple(cfg))}
        runner = backends[name].fast_runner_for(problem, record)
        assert runner.func is fast and runner.keywords == {"cfg": cfg}, name
        assert backends[name].fast_runner_for(problem) is fast
        assert backends[name].checked_runner_for(problem, record).func is not fast


class _Param:
    def __init__(self, name: str, default: object = inspect.Parameter.empty) -> None:
        self.name, self.default = name, default


class CompiledKernel:
    """Stands for Triton's compiled kernel (Launch reads its class name): its launcher logs
    each launch, or refuses its arguments as another Triton's launcher would."""

    def __init__(self, log: list, refuse: bool) -> None:
        self.log, self.refuse = log, refuse

    def __getitem__(self, grid: tuple):
        def run(*args):
            if self.refuse:
                raise TypeError("launch() takes 14 positional arguments")
            self.log.append(("direct", grid, args))

        return run


class _Jit:
    """Stands for a JIT function of parameters (x, n, BLOCK, FLAG=False)."""

    def __init__(self, refuse: bool = False, compiled: bool = True) -> None:
        self.arg_names = ["x", "n", "BLOCK", "FLAG"]
        self.params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", False)]
        self.log: list = []
        self.refuse, self.compiled = refuse, compiled

    def __getitem__(self, grid: tuple):
        def run(*args, **options):
            self.log.append(("jit", grid, args, options))
            return CompiledKernel(self.log, self.refuse) if self.compiled else None

        return run


def test_a_launch_goes_through_the_jit_once_then_through_the_compiled_launcher():
    fn = _Jit()
    launch = hopper_launch.Launch(fn, (4,), BLOCK=64, num_warps=4)
    launch("a", 7)
    launch("b", 8)
    launch("c", 9)
    assert fn.log == [
        ("jit", (4,), ("a", 7), {"BLOCK": 64, "num_warps": 4}),
        ("direct", (4, 1, 1), ("b", 8, 64, False)),  # every parameter, the grid in 3 dimensions
        ("direct", (4, 1, 1), ("c", 9, 64, False)),
    ]


def test_a_launcher_that_refuses_the_direct_form_leaves_the_launch_on_the_jit():
    fn = _Jit(refuse=True)
    launch = hopper_launch.Launch(fn, (2, 3), BLOCK=32)
    for x in "abc":
        launch(x, 1)
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "jit"]  # each call launched once
    assert [entry[2][0] for entry in fn.log] == ["a", "b", "c"]


def test_a_launch_that_compiles_nothing_stays_on_the_jit():
    fn = _Jit(compiled=False)  # as Triton's interpreter returns
    launch = hopper_launch.Launch(fn, (1,), BLOCK=16)
    launch("a", 1)
    launch("b", 2)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]


class CudaLauncher:
    """Stands for Triton 3.6's launcher object (the raw form reads its class name and fields):
    ``launch`` logs its arguments, or refuses them as another launcher would."""

    def __init__(self, log: list, refuse: bool, scratch: int) -> None:
        self.log, self.refuse = log, refuse
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        if self.refuse:
            raise TypeError("function takes at least 20 arguments")
        self.log.append(("raw", args))


class _RawJit(_Jit):
    """A JIT function whose compiled kernels carry a 3.6-style launcher."""

    def __init__(self, refuse_raw: bool = False, scratch: int = 0) -> None:
        super().__init__()
        self.refuse_raw, self.scratch = refuse_raw, scratch

    def __getitem__(self, grid: tuple):
        def run(*args, **options):
            self.log.append(("jit", grid, args, options))
            kernel = CompiledKernel(self.log, False)
            kernel.run = CudaLauncher(self.log, self.refuse_raw, self.scratch)
            kernel.function, kernel.packed_metadata = 77, (4, 1, 0)
            return kernel

        return run


@pytest.fixture
def triton36(monkeypatch):
    """Triton 3.6's launcher format, its empty chains of launch hooks, a CUDA device 0 whose
    stream is 5."""
    from triton import knobs
    from triton.backends.nvidia import driver

    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain(reversed=True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 5, raising=False)
    return knobs.runtime


@pytest.mark.parametrize("hooks", ["empty chains", "none"])
def test_with_triton_36s_launcher_a_launch_calls_it_as_triton_does(triton36, monkeypatch, hooks):
    if hooks == "none":  # as a Triton whose hooks are plain attributes leaves them
        monkeypatch.setattr(triton36, "launch_enter_hook", None)
        monkeypatch.setattr(triton36, "launch_exit_hook", None)
    fn = _RawJit()
    launch = hopper_launch.Launch(fn, (4, 2), BLOCK=64, num_warps=4)
    launch("a", 7)
    assert not launch.direct
    launch("b", 8)
    assert launch.direct
    launch("c", 9)
    leading = (4, 2, 1, 5, 77, False, True, None, None, (4, 1, 0), None, None, None)
    assert fn.log[1:] == [
        ("raw", (*leading, "b", 8, 64, False)),
        ("raw", (*leading, "c", 9, 64, False)),
    ]


def test_a_launcher_refusing_the_raw_form_is_called_through_the_compiled_kernel(triton36):
    fn = _RawJit(refuse_raw=True)
    launch = hopper_launch.Launch(fn, (3,), BLOCK=16)
    for x in "abc":
        launch(x, 1)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "direct"]
    assert launch.direct


@pytest.mark.parametrize(
    "why", ["scratch", "another format", "enter hook", "exit hook", "enter chained", "exit chained"]
)
def test_the_raw_form_gives_way_to_the_compiled_kernels_launch(triton36, monkeypatch, why):
    """Where the launcher needs scratch, parses other arguments, or a profiler hooks launches,
    Triton's own path launches (the hooks are read at each launch)."""
    from triton.backends.nvidia import driver

    fn = _RawJit(scratch=64 if why == "scratch" else 0)
    if why == "another format":
        monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKpOOOOOO")
    launch = hopper_launch.Launch(fn, (3,), BLOCK=16)
    launch("a", 1)
    if why.endswith("hook"):  # set as a function
        monkeypatch.setattr(triton36, f"launch_{why.split()[0]}_hook", print)
    elif why.endswith("chained"):  # added to Triton's chain, as its profiler does
        getattr(triton36, f"launch_{why.split()[0]}_hook").add(print)
    launch("b", 2)
    launch("c", 3)
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "direct"]


def _wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's wrapper of a launcher whose kernel takes host tensor descriptors, as
    ``triton.backends.nvidia.driver`` writes it (the raw form reads its closure)."""
    from triton.backends.nvidia import driver

    def inner(*args):
        final_args = list(args[: driver._BASE_ARGS_FORMAT_LEN])
        d = 0
        for i, arg in enumerate(args[driver._BASE_ARGS_FORMAT_LEN :]):
            if i in tensordesc_indices:
                final_args.extend(driver.make_tensordesc_arg(arg, tensordesc_meta[d]))
                d += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


@dataclasses.dataclass
class _Desc:
    base: torch.Tensor
    shape: list
    strides: list
    padding: str = "zero"


@pytest.fixture
def encodings(triton36, monkeypatch):
    """Triton 3.6's descriptor encoding, logged: one entry per ``cuTensorMapEncodeTiled``."""
    from triton.backends.nvidia import driver

    log: list = []

    def encode(desc, meta):
        log.append((desc.base.data_ptr(), tuple(desc.shape), meta))
        return [f"map{len(log)}", *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode, raising=False)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    return log


class _DescJit(_RawJit):
    """A JIT function of parameters (w_desc, x_desc, n, BLOCK, FLAG) whose 3.6-style launcher
    is wrapped to take the two descriptors (metadata ``metas``)."""

    def __init__(self, metas: list) -> None:
        super().__init__()
        self.arg_names = ["w_desc", "x_desc", "n", "BLOCK", "FLAG"]
        self.params = [_Param("w_desc"), _Param("x_desc"), *self.params[1:]]
        self.metas = metas

    def __getitem__(self, grid: tuple):
        run = super().__getitem__(grid)

        def wrapped(*args, **options):
            kernel = run(*args, **options)
            raw = kernel.run.launch
            kernel.run.launch = _wrap_handle_tensordesc(raw, {0, 1}, self.metas)
            return kernel

        return wrapped


def test_tma_descriptors_are_encoded_once_per_distinct_fields(encodings):
    fn = _DescJit([{"swizzle": 128}, {"swizzle": 64}])
    launch = hopper_launch.Launch(fn, (2,), BLOCK=32)
    w, x, x2 = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    for call, xs in enumerate([x, x, x, x2, x]):  # new descriptor objects every call
        launch(_Desc(w, [8, 8], [8, 1]), _Desc(xs, [4, 16], [16, 1]), call)
    assert launch.direct
    # the JIT's call encodes nothing here; calls 2-5 encode w and x once, then x2 once
    assert encodings == [
        (w.data_ptr(), (8, 8), {"swizzle": 128}),
        (x.data_ptr(), (4, 16), {"swizzle": 64}),
        (x2.data_ptr(), (4, 16), {"swizzle": 64}),
    ]
    leading = (2, 1, 1, 5, 77, False, True, None, None, (4, 1, 0), None, None, None)
    raw = [entry[1] for entry in fn.log if entry[0] == "raw"]
    assert raw[0] == (*leading, "map1", 8, 8, 8, 1, "map2", 4, 16, 16, 1, 1, 32, False)
    assert raw[2] == (*leading, "map1", 8, 8, 8, 1, "map3", 4, 16, 16, 1, 3, 32, False)
    assert raw[3] == (*leading, "map1", 8, 8, 8, 1, "map2", 4, 16, 16, 1, 4, 32, False)
    # other fields are another encoding: a new shape, stride or padding
    launch(_Desc(w, [8, 4], [8, 1]), _Desc(x, [4, 16], [16, 1], "nan"), 5)
    assert len(encodings) == 5


def test_the_kept_encodings_start_again_when_full(encodings, monkeypatch):
    monkeypatch.setattr(hopper_launch, "MAX_DESCRIPTORS", 3)
    fn = _DescJit([{}, {}])
    launch = hopper_launch.Launch(fn, (2,), BLOCK=32)
    w, xs = torch.zeros(8), [torch.zeros(8) for _ in range(3)]
    for call, x in enumerate([xs[0], xs[0], xs[1], xs[2], xs[0]]):
        launch(_Desc(w, [8], [1]), _Desc(x, [8], [1]), call)
    # call 3 found three kept (w, xs[0], xs[1]) and started again with xs[2]; call 4 then
    # encodes w and xs[0] again
    assert [e[0] for e in encodings] == [
        w.data_ptr(), xs[0].data_ptr(), xs[1].data_ptr(), xs[2].data_ptr(), w.data_ptr(),
        xs[0].data_ptr(),
    ]  # fmt: skip


def test_descriptors_without_metadata_are_encoded_by_triton_at_every_launch(encodings):
    """Those hold the tensor itself (Triton's own decomposition): nothing is kept."""
    fn = _DescJit([None, None])
    launch = hopper_launch.Launch(fn, (2,), BLOCK=32)
    w = torch.zeros(8)
    for call in range(4):
        launch(_Desc(w, [8], [1]), _Desc(w, [8], [1]), call)
    assert len(encodings) == 6  # calls 2-4, two descriptors each


def test_all_direct_waits_for_every_launch_of_a_plan(triton36):
    first, second = (hopper_launch.Launch(_RawJit(), (1,), BLOCK=8) for _ in range(2))
    for call in range(2):
        first("x", call)
    assert hopper_launch.all_direct((first, None)) and not hopper_launch.all_direct((first, second))
    second("x", 0)
    second("x", 1)
    assert hopper_launch.all_direct((first, second, None))


@pytest.mark.parametrize("a_sf_layout", ["128x4", "8x4"])
def test_unviewed_operands_point_where_their_word_views_do(a_sf_layout):
    """A plan whose launches are direct passes the call's tensors for the views the kernels
    were compiled for: the same data pointers, the weight's scales given either way round."""
    from fp4select.backends import hopper_args

    args = list(_args(m=5, n=48, k=256, a_sf_layout=a_sf_layout))
    for scales in (args[3], args[3].T.contiguous().T):
        args[3] = scales
        views = hopper_args.operand_words(tuple(args), torch.int32, with_scales=True)
        plain = hopper_args.operand_words(tuple(args), torch.int32, with_scales=True, direct=True)
        assert views is not None and views[1].dtype == torch.int32
        assert [t.data_ptr() for t in plain] == [t.data_ptr() for t in views]
    wide = hopper_args.operand_words(tuple(args), torch.int64)
    assert [
        t.data_ptr() for t in hopper_args.operand_words(tuple(args), torch.int64, direct=True)
    ] == [t.data_ptr() for t in wide]


def test_an_unchecked_descriptor_is_the_checked_one():
    """hopper-ws' direct launches describe their tiles without the constructor's checks: the
    same fields, the padding's default included, as the checked descriptor of the same tile."""
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    w_layout, x_layout = triton_hopper._ws_tile_layouts(128, 16, 128)
    words = torch.zeros((512, 64), dtype=torch.int32)
    planes = torch.zeros((128, 128), dtype=torch.float16)
    for base, block, layout in ((words, [128, 16], w_layout), (planes, [128, 128], x_layout)):
        shape, strides = list(base.shape), list(base.stride())
        checked = gluon.TensorDescriptor(base, shape, strides, block, layout)
        made = triton_hopper._unchecked(base, shape, strides, block, layout)
        # field by field, the base by identity: Python 3.13's dataclass __eq__ compares the
        # fields with == one by one, and two tensors' == is not a bool
        names = [f.name for f in dataclasses.fields(checked) if f.name != "base"]
        assert made.base is checked.base and names
        assert [getattr(made, n) for n in names] == [getattr(checked, n) for n in names]
