"""Backends that fail the ways real kernels fail, for the sandbox's fault-injection tests.

They are module-level functions so the sandbox child can import them by name, exactly as it
imports a user's plugin. Each faulty one appends a line (its pid) to ``$FAULT_MARKER_DIR/<name>``
*before* it misbehaves, so a test can count from outside how often, and in which processes, it
ran: a second process that reuses a decision must leave every count unchanged.

Some fail late or only once (``late_killer``'s thread kills the process while ``witness`` runs;
``crash_once`` crashes only the first time it ever runs), so that blame can be tested; some are
hostile to the protocol (``forges_*``, ``leftover_then_zeros``, ``malformed_once`` write events
onto the channel, the last with the request id it finds on the stack, as a determined plugin
would); ``spawns_grandchild`` leaves a helper process behind.

All take flashinfer.mm_fp4's positional order without ``backend`` (the runner signature).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import torch

from fp4select import register_backend, unregister_backend
from fp4select.formats import reference_mm_fp4
from fp4select.sandbox import PROTOCOL_FD_ENV

MARKER_ENV = "FAULT_MARKER_DIR"
SLOW_ENV = "FAULT_SLOW_S"
MALFORMED_ENV = "FAULT_MALFORMED"  # which malformed event ``malformed_once`` writes
LEFTOVER_ID_FILE = "leftover_id"  # in the marker directory: an earlier request's id
GRANDCHILD_PID_FILE = "grandchild_pid"  # in the marker directory
WITNESS_HOLD_S = 0.5  # the witness's first call lasts this long: the late kill lands in it
LATE_KILL_FALLBACK_S = 10.0
CRASH_M = 7  # the middle validation M of bucket 8 (validation Ms are 5, 7, 8)
VALIDATION_CALLS = 4  # three Ms with out=None, then one into a caller's out=

_calls: dict[str, int] = {}


def mark(name: str) -> None:
    directory = os.environ.get(MARKER_ENV)
    if directory:
        with open(os.path.join(directory, name), "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()}\n")


def count(directory: os.PathLike | str, name: str) -> int:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        return len(fh.read().split())


def _segfault() -> None:
    ctypes.string_at(0)  # a read of address 0: SIGSEGV, as an out-of-bounds kernel launch
    os.kill(os.getpid(), signal.SIGSEGV)  # in case address 0 happens to be mapped


def good(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4, pdl):
    return reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4
    )


def slow_good(*args):
    """Right, but each call takes FAULT_SLOW_S: slow progress must not look like a hang."""
    time.sleep(float(os.environ.get(SLOW_ENV, "0.6")))
    return good(*args)


def segfault(*args):
    mark("segfault")
    _segfault()


def abort(*args):
    mark("abort")
    os.abort()


def exit_hard(*args):
    mark("exit_hard")
    os._exit(3)


def hang(*args):
    mark("hang")
    while True:
        time.sleep(3600)


def raises(*args):
    mark("raises")
    raise RuntimeError("backend bug: index out of range in tile scheduler")


def cuda_error(*args):
    """What torch raises after a kernel's illegal access (this process's context is now dead)."""
    mark("cuda_error")
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def oom(*args):
    """A real allocation failure, bounded: the address space is capped for this call only."""
    mark("oom")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as fh:
        used = int(fh.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))
    try:
        workspace = torch.empty(1 << 30, dtype=torch.uint8)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    del workspace
    return good(*args)


def cuda_fault(a, *args):
    """A real sticky CUDA fault (a device-side assert from an out-of-range gather) on a GPU."""
    mark("cuda_fault")
    index = torch.full((1,), 1 << 20, device=a.device)
    torch.zeros(4, device=a.device)[index]
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    return good(a, *args)


def nan(*args):
    mark("nan")
    return good(*args).fill_(float("nan"))


def zeros(*args):
    mark("zeros")
    return good(*args).zero_()


def transposed(a, b, *args):
    """Writes the (N, M) product: the layout mix-up a wrong-major epilogue makes."""
    mark("transposed")
    ref = good(a, b, *args[:4], None, *args[5:])
    return ref.T.contiguous()


def crash_at_one_m(a, *args):
    """Right everywhere except one M inside the bucket (a tile-boundary bug)."""
    if a.shape[0] == CRASH_M:
        mark("crash_at_one_m")
        _segfault()
    return good(a, *args)


def crash_in_timing(*args):
    """Passes validation, then crashes once it is being timed (a race under repetition)."""
    _calls["crash_in_timing"] = n = _calls.get("crash_in_timing", 0) + 1
    if n > VALIDATION_CALLS:
        mark("crash_in_timing")
        _segfault()
    return good(*args)


def stdout_noise(*args):
    """Right, but prints: to stdout, to fd 1, and (first call) garbage onto the protocol pipe."""
    _calls["stdout_noise"] = n = _calls.get("stdout_noise", 0) + 1
    if n == 1:
        print("hello from stdout_noise", flush=True)
        os.write(1, b"raw bytes on fd 1\n")
        fd = os.environ.get(PROTOCOL_FD_ENV)
        if fd:
            os.write(int(fd), b"garbage that is not JSON\n[1, 2, 3]\n")
    return good(*args)


# -- faults that fire late, or only once ------------------------------------------------------


def _marked(name: str) -> bool:
    directory = os.environ.get(MARKER_ENV)
    return bool(directory) and count(directory, name) > 0


def _late_kill() -> None:
    deadline = time.monotonic() + LATE_KILL_FALLBACK_S
    while not _marked("witness") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGSEGV)


def late_killer(*args):
    """Right, but its first call starts a thread that kills the process once ``witness`` runs.

    So the death lands while another, innocent backend is running: the blame must not.
    """
    _calls["late_killer"] = n = _calls.get("late_killer", 0) + 1
    if n == 1:
        mark("late_killer")
        threading.Thread(target=_late_kill, daemon=True).start()
    return good(*args)


def witness(*args):
    """Right; its first call in a process is marked and lasts WITNESS_HOLD_S."""
    _calls["witness"] = n = _calls.get("witness", 0) + 1
    if n == 1:
        mark("witness")
        time.sleep(WITNESS_HOLD_S)
    return good(*args)


def crash_once(*args):
    """Segfaults the first time it ever runs (a marker file remembers), then is right."""
    if not _marked("crash_once"):
        mark("crash_once")
        _segfault()
    return good(*args)


def spawns_grandchild(*args):
    """Right, but leaves a long-running helper process behind (its pid in a file)."""
    _calls["spawns_grandchild"] = n = _calls.get("spawns_grandchild", 0) + 1
    directory = os.environ.get(MARKER_ENV)
    if n == 1 and directory:
        helper = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(directory, GRANDCHILD_PID_FILE), "a", encoding="utf-8") as fh:
            fh.write(f"{helper.pid}\n")
    return good(*args)


# -- forgers: backends that write onto the sandbox's protocol channel --------------------------


def _protocol_write(event: dict) -> None:
    fd = os.environ.get(PROTOCOL_FD_ENV)
    if fd:
        os.write(int(fd), ("\n" + json.dumps(event) + "\n").encode())


def _request_id() -> str | None:
    """The id of the request being served, found as a hostile plugin would: on the stack.

    None where requests carry no id (so the same event still reaches an older sandbox).
    """
    frame = sys._getframe(1)
    while frame is not None:
        request = frame.f_locals.get("request")
        if isinstance(request, dict) and isinstance(request.get("id"), str):
            return request["id"]
        frame = frame.f_back
    return None


def _passed(name: str) -> dict:
    return {
        "backend": name,
        "status": "passed",
        "reason": "",
        "m": None,
        "worst_ratio": 0.0,
        "deterministic": True,
        "detail": {},
    }


def _forged_result(request_id: str, *names: str) -> dict:
    result = {
        "verdicts": {n: _passed(n) for n in names},
        "timings": {},
        "method": "not timed: one correct candidate",
        "seconds": 0.1,
        "aborted": False,
    }
    return {"event": "result", "id": request_id, "result": result}


def _zeros(*args):
    return good(*args).zero_()


def forges_result(*args):
    """Returns zeros, and on every call claims on the channel (with a wrong id) it passed."""
    mark("forges_result")
    _protocol_write(_forged_result("1-0000000000000000", "forges_result"))
    return _zeros(*args)


def forges_verdict(*args):
    """Returns zeros, and on every call announces (with a wrong id) a passed verdict."""
    mark("forges_verdict")
    _protocol_write({"event": "verdict", "id": "0-forged", "verdict": _passed("forges_verdict")})
    return _zeros(*args)


def leftover_then_zeros(*args):
    """Returns zeros; the first time, an earlier request's result line appears on the channel.

    That is the desynchronisation: a result left over from the previous key, naming this
    backend passed, read as this key's answer.
    """
    directory = os.environ.get(MARKER_ENV)
    if directory and not _marked("leftover_then_zeros"):
        mark("leftover_then_zeros")
        with open(os.path.join(directory, LEFTOVER_ID_FILE), encoding="utf-8") as fh:
            earlier = fh.read().strip()
        _protocol_write(_forged_result(earlier, "leftover_then_zeros"))
    return _zeros(*args)


MALFORMED = {
    "verdict-not-an-object": lambda rid: {"event": "verdict", "id": rid, "verdict": 5},
    "empty-result": lambda rid: {"event": "result", "id": rid, "result": {}},
    "verdict-for-a-ghost": lambda rid: {"event": "verdict", "id": rid, "verdict": _passed("ghost")},
    "nan-ratio": lambda rid: {
        "event": "verdict",
        "id": rid,
        "verdict": {**_passed("malformed_once"), "status": "wrong", "worst_ratio": float("nan")},
    },
}


def malformed_once(*args):
    """Right; the first time it runs, a wrong-shaped event *with the right id* hits the channel."""
    if not _marked("malformed_once"):
        mark("malformed_once")
        _protocol_write(MALFORMED[os.environ[MALFORMED_ENV]](_request_id()))
    return good(*args)


FAULTS = {
    f.__name__: f
    for f in (
        good,
        slow_good,
        segfault,
        abort,
        exit_hard,
        hang,
        raises,
        cuda_error,
        cuda_fault,
        oom,
        nan,
        zeros,
        transposed,
        crash_at_one_m,
        crash_in_timing,
        stdout_noise,
        late_killer,
        witness,
        crash_once,
        spawns_grandchild,
        forges_result,
        forges_verdict,
        leftover_then_zeros,
        malformed_once,
    )
}


def register(*names: str, devices: tuple[str, ...] = ("cpu",)) -> None:
    for name in names:
        register_backend(FAULTS[name], name=name, devices=set(devices), formats={"nvfp4"})


def unregister(*names: str) -> None:
    for name in names:
        with contextlib.suppress(KeyError):
            unregister_backend(name)
