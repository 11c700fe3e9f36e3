"""The warm path's C++ key: every tensor's metadata in one call, built on the user's machine.

Design rules:

* Why it exists. best_mm_fp4's warm path must see, on every call, the dtype, device, sizes
  and strides of up to six tensors, so that a call the first call would refuse is refused
  every time. Read from Python, each property costs 60-120 ns and PyTorch's ``TensorGuards``
  about 100 ns a tensor: the Python path measured 1.4 µs over the direct call, and the warm
  path is allowed 1 µs. ``native_key.cpp`` reads all of it from the tensors' C++ objects in
  one call (tens of ns) and returns an int that stands for that exact metadata.
* Exact, never hashed. The C++ side interns each distinct encoding: two calls share an int
  only if every word of every tensor is equal. The int *is* the full metadata, so the warm
  path needs no separate guard, and no collision can admit a call.
* Optional and never in the way. It is compiled with the machine's C++ compiler against
  PyTorch's own headers (every torch wheel ships them), in about 15 s. With
  ``FP4SELECT_NATIVE=auto`` (the default) a process loads a build that exists, and otherwise
  starts one in a background thread the first time it needs a selector, so no call waits for
  it; ``fp4select native --build`` (and ``fp4select warm``) build it up front. Until it is
  loaded, or where it cannot be built, the Python path (fp4select.tensor_guard) serves with
  the same answers. ``FP4SELECT_NATIVE=off`` never builds or loads it.
* Code, not data. The decision cache holds data only; this library is code, so it lives
  apart from it, in ``FP4SELECT_NATIVE_DIR`` (default: PyTorch's own folder for extensions
  it compiles, ``torch_extensions``), in a folder named from the source, torch's version and
  build, and Python's ABI: an upgrade builds anew and never loads a build made for another
  torch. A library is loaded only if it and its folder belong to this user and nobody else
  may write them, and it is used only after a self-test on real tensors passes.
* Builds are atomic and shared: one process compiles at a time (a file lock); the compiler
  writes a temporary file that is renamed into place, so a reader never sees half a library,
  and a failed build leaves nothing behind. A failure is reported once per process (a warning
  and ``status()``), never raised into a caller of best_mm_fp4.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["Key", "build", "default_dir", "library_path", "load", "start", "status"]

log = logging.getLogger(__name__)

Key = Callable[..., "int | None"]
MODULE = "fp4select_native_key"  # the C++ file's PyInit_ name
SOURCE = Path(__file__).with_name("native_key.cpp")
BUILD_TIMEOUT_S = 600.0
_LOCK_TIMEOUT_S = BUILD_TIMEOUT_S + 60.0

_state_lock = threading.Lock()
_loaded: dict[str, Key] = {}  # library path -> its key function
_status: dict[str, str] = {}  # folder -> what happened to it in this process
_building: set[str] = set()  # folders a background thread is building


def _after_fork_in_child() -> None:
    """A fork while a build thread held the lock must not deadlock the child; the thread is
    not in the child, so neither is its build: the child may start its own."""
    global _state_lock
    _state_lock = threading.Lock()
    for name in _building:
        _status.pop(name, None)
    _building.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_dir() -> Path:
    """PyTorch's folder for extensions it compiles (TORCH_EXTENSIONS_DIR or its default), found
    as torch.utils.cpp_extension finds it, without importing that module on every start-up."""
    import platformdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        platformdirs.user_cache_dir("torch_extensions", appauthor=False)
    )
    return Path(root) / "fp4select"


def _tag() -> str:
    """Changes with anything the library's binary depends on."""
    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        sys.implementation.cache_tag.encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
        sys.platform.encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def library_path(folder: str | os.PathLike[str] | None = None) -> Path:
    """Where this torch and Python's build of the key lives (it may not exist yet)."""
    root = Path(folder) if folder is not None else default_dir()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return root / _tag() / f"{MODULE}{suffix}"


def _why_untrusted(path: Path) -> str | None:
    """Refuse a file or folder that someone other than this user could have written."""
    if not hasattr(os, "geteuid"):
        return "only POSIX systems can check who owns the library"
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if os.path.islink(path):
        return f"{path} is a symbolic link"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
    if info.st_mode & 0o022:
        return f"{path} may be written by others (mode {oct(info.st_mode & 0o777)})"
    return None


def _self_test(key: Key) -> str | None:
    """None if the key tells apart every property the warm path relies on, else what failed."""
    base = torch.zeros(4, 8, dtype=torch.uint8)
    same = torch.ones(4, 8, dtype=torch.uint8)
    variants = {
        "base": base,
        "dtype": base.view(torch.int8),
        "strides": base.t().contiguous().t(),
        "sizes": base[:2],
        "device": torch.empty(4, 8, dtype=torch.uint8, device="meta"),
        "none": None,
    }
    plain, tracked = torch.zeros(2, 2), torch.zeros(2, 2, requires_grad=True)
    try:
        ids = {name: key(t, same) for name, t in variants.items()}
        if key(same, same) != ids["base"] or key(base, same) != ids["base"]:
            return "equal metadata gave two keys"
        if len(set(ids.values())) != len(ids) or None in ids.values():
            return f"different metadata gave one key: {ids}"
        if key(plain, same) == key(tracked, same):
            return "requires_grad did not change the key"
        if key(1.0, same) is not None or key(base, base) != key(same, base):
            return "a non-tensor was keyed, or the same tensor twice was not"
    except Exception as exc:  # a library that raises is a broken one
        return f"the self-test raised {type(exc).__name__}: {exc}"
    return None


def _import(path: Path) -> Key:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    key: Key = module.key
    return key


def load(folder: str | os.PathLike[str] | None = None) -> Key | None:
    """The key function of an existing trusted build that passes its self-test, else None.

    Cheap when there is nothing to load (one stat); never builds.
    """
    path = library_path(folder)
    with _state_lock:
        if str(path) in _loaded:
            return _loaded[str(path)]
    if not path.exists():
        return None
    why = _why_untrusted(path.parent.parent) or _why_untrusted(path.parent) or _why_untrusted(path)
    if why is None:
        try:
            key = _import(path)
        except Exception as exc:  # a damaged or foreign file at our path
            why = f"{path} does not load: {type(exc).__name__}: {exc}"
        else:
            why = _self_test(key)
    with _state_lock:
        if why is not None:
            if _status.get(str(path.parent.parent)) != f"refused: {why}":
                log.warning("fp4select: not using the native warm-path key: %s", why)
            _status[str(path.parent.parent)] = f"refused: {why}"
            return None
        _loaded[str(path)] = key
        _status[str(path.parent.parent)] = "loaded"
    return key


def _compiler() -> list[str]:
    """$CXX (split as a shell would: ``ccache g++``), else the first C++ compiler on PATH."""
    chosen = shlex.split(os.environ.get("CXX") or "")
    if chosen:
        return chosen
    return [next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), "c++")]


def _compile_command(source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    command = [
        *_compiler(),
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(target),
        f"-L{lib_dir}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-Wl,-rpath,{lib_dir}",
    ]
    if sys.platform == "darwin":  # Python's symbols come from the interpreter that loads it
        command += ["-undefined", "dynamic_lookup"]
    return command


def build(folder: str | os.PathLike[str] | None = None) -> Key:
    """Compile the key for this torch and Python (unless built already) and load it.

    Raises ``RuntimeError`` saying why when it cannot: no compiler, a refused folder, a
    compiler error (its last lines), a library that fails its self-test.
    """
    from filelock import FileLock, Timeout

    path = library_path(folder)
    key = load(folder)
    if key is not None:
        return key
    if sys.platform == "win32":
        raise RuntimeError("the native key is built on Linux and macOS only")
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    why = _why_untrusted(path.parent.parent) or _why_untrusted(path.parent)
    if why is not None:
        raise RuntimeError(f"will not build in {path.parent}: {why}")
    try:
        with FileLock(str(path.parent / "build.lock"), timeout=_LOCK_TIMEOUT_S):
            if not path.exists():  # another process may have built it while we waited
                _compile(path)
    except Timeout:
        raise RuntimeError(f"another process held {path.parent}/build.lock too long") from None
    key = load(folder)
    if key is None:
        status = _status.get(str(path.parent.parent), "")
        raise RuntimeError(f"built {path}, but it is not usable: {status}")
    return key


# The compiler's output is made this user's alone and renamed into place by the same shell
# that ran the compiler, so a build outlives a process that exits first (a short-lived command,
# a background build at interpreter exit) and still leaves a whole library or nothing.
_COMPILE_AND_RENAME = (
    '"$@" && chmod 755 "$FP4SELECT_TMP" && mv -f "$FP4SELECT_TMP" "$FP4SELECT_LIB" '
    '|| { rc=$?; rm -f "$FP4SELECT_TMP"; exit $rc; }'
)


def _compile(path: Path) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    command = _compile_command(SOURCE, temporary)
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C++ compiler: {command[0]!r} was not found (set CXX)")
    env = {**os.environ, "FP4SELECT_TMP": str(temporary), "FP4SELECT_LIB": str(path)}
    try:
        done = subprocess.run(
            ["sh", "-c", _COMPILE_AND_RENAME, "sh", *command],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        temporary.unlink(missing_ok=True)
        raise RuntimeError(f"the compiler ran past {BUILD_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"the compiler failed (exit {done.returncode}):\n{tail}")


def start(folder: str | os.PathLike[str] | None, on_ready: Callable[[Key], None]) -> Key | None:
    """The key now if a build exists; else build it in a background thread and hand it to
    ``on_ready`` when it is loaded. A build that fails is reported once (a warning) and not
    tried again in this process."""
    key = load(folder)
    if key is not None:
        return key
    name = str(library_path(folder).parent.parent)
    with _state_lock:
        if name in _building or _status.get(name, "").startswith(("failed", "refused")):
            return None
        _building.add(name)
        _status[name] = "building in the background"

    def run() -> None:
        try:
            built = build(folder)
        except Exception as exc:
            with _state_lock:
                _status[name] = f"failed: {exc}"
            log.warning(
                "fp4select: the native warm-path key could not be built (the Python path "
                "serves, about 1 µs slower a call): %s",
                exc,
            )
        else:
            on_ready(built)
        finally:
            with _state_lock:
                _building.discard(name)

    threading.Thread(target=run, name="fp4select-native-build", daemon=True).start()
    return None


def status(folder: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What doctor and ``fp4select native`` print: the path, whether it is built, and what
    happened to it in this process."""
    path = library_path(folder)
    with _state_lock:
        happened = _status.get(str(path.parent.parent))
    return {
        "path": str(path),
        "built": path.exists(),
        "loaded": str(path) in _loaded,
        "status": happened or ("built, not loaded yet" if path.exists() else "not built"),
    }
