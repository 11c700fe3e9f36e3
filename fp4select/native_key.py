"""The warm path's C++ key: every tensor's metadata in one call, loaded only from a file nobody
else could have written.

Design rules:

* Why it exists. best_mm_fp4's warm path must see, on every call, the dtype, device, sizes
  and strides of up to six tensors, so that a call the first call would refuse is refused
  every time. Read from Python that misses the warm path's 1 µs target (docs/measurements.md);
  ``native_key.cpp`` reads it all from the tensors' C++ objects in one call and returns an int
  that stands for that exact metadata.
* Exact, never hashed. The C++ side interns each distinct encoding: two calls share an int
  only if every word of every tensor is equal, so the int needs no guard and no collision can
  admit a call.
* A serving process never starts a compiler. This module only finds, checks and loads a
  build (fp4select.native_build builds, at deploy time). With ``FP4SELECT_NATIVE=auto`` a
  process loads a build that exists and passes the checks below, else the Python path
  (fp4select.tensor_guard) serves with the same answers; ``off`` never loads it.
* The lifecycle is one function: ``for_settings(settings)``, computed when the settings are
  made; api keeps the result in one module global, read once per call.
* Code, not data: the library lives apart from the decision cache, in ``FP4SELECT_NATIVE_DIR``
  (default: PyTorch's ``torch_extensions``), in a folder named from the source, torch's version
  and build, and Python's ABI, so a build is never loaded by another torch.
* Who may have written it (docs/native_key.md says why each rule is there). Loading runs the
  library's start-up code, so the checks come first and are made on what is loaded: every
  folder from ``/`` down (links resolved, then each ``lstat``-ed) is root's or this user's and
  not group/other-writable unless root-owned and sticky; fp4select's own two folders are this
  user's alone; the library is opened once (``O_NOFOLLOW | O_NONBLOCK``), checked by
  ``fstat`` on that descriptor, and that same open file is loaded through
  ``/proc/self/fd/N`` (Linux only; elsewhere the Python path serves), the descriptor kept
  open for the process's life. A refusal is one line in ``doctor`` and one warning.
* A self-test on real tensors then decides whether the warm path *uses* it: it guards against
  a wrong build, not a hostile one (its start-up code has run by then).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import stat
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fp4select.settings import Settings

__all__ = [
    "Key",
    "default_dir",
    "for_settings",
    "library_path",
    "load",
    "status",
    "why_untrusted_folder",
]

log = logging.getLogger(__name__)

Key = Callable[..., "int | None"]
MODULE = "fp4select_native_key"  # the C++ file's PyInit_ name
SOURCE = Path(__file__).with_name("native_key.cpp")

_state_lock = threading.Lock()
_loaded: dict[str, Key] = {}  # library path -> its key function
_status: dict[str, str] = {}  # folder -> what happened to it in this process
_kept_open: list[int] = []  # descriptors of libraries handed to the loader (never closed)


def _after_fork_in_child() -> None:
    """A fork while another thread held the lock must not deadlock the child."""
    global _state_lock
    _state_lock = threading.Lock()


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


def _why_mode(what: str, info: os.stat_result, *, own: bool) -> str | None:
    """``own``: a folder or file fp4select made (this user's alone); else an ancestor folder
    (root's or this user's; group/other-writable only as a root-owned sticky folder)."""
    uid = os.geteuid()
    if own and info.st_uid != uid:
        return f"{what} belongs to uid {info.st_uid}, not to this user ({uid})"
    if not own and info.st_uid not in (0, uid):
        return f"{what} belongs to uid {info.st_uid}, neither root nor this user ({uid})"
    if info.st_mode & 0o022:
        sticky_root = not own and info.st_uid == 0 and info.st_mode & stat.S_ISVTX
        if not sticky_root:
            mode = oct(info.st_mode & 0o7777)
            return f"{what} may be written by others (mode {mode})"
    return None


def why_untrusted_folder(folder: Path, own_levels: int) -> str | None:
    """None if nobody but root and this user could have changed ``folder`` or what is in it:
    every folder from ``/`` down, after resolving symbolic links; the last ``own_levels``
    (the folders fp4select made) must be this user's own."""
    if not hasattr(os, "geteuid"):
        return "only POSIX systems can check who owns the library"
    real = Path(os.path.realpath(folder))
    chain = [*reversed(real.parents), real]
    for depth, part in enumerate(chain):
        try:
            info = os.lstat(part)
        except OSError as exc:
            return f"cannot stat {part}: {exc.strerror}"
        if stat.S_ISLNK(info.st_mode):
            return f"{part} became a symbolic link while it was checked"
        if not stat.S_ISDIR(info.st_mode):
            return f"{part} is not a folder"
        why = _why_mode(f"folder {part}", info, own=depth >= len(chain) - own_levels)
        if why is not None:
            return why
    return None


def _open_trusted(path: Path) -> int:
    """A descriptor of the library at ``path`` that passed every check, else ``OSError`` or
    ``PermissionError`` saying why (the caller reports it)."""
    if not os.path.isdir("/proc/self/fd"):
        raise PermissionError(
            "loading the checked file itself needs /proc/self/fd (Linux); the Python path serves"
        )
    why = why_untrusted_folder(path.parent, own_levels=2)
    if why is not None:
        raise PermissionError(why)
    real = Path(os.path.realpath(path.parent)) / path.name
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        if os.path.islink(real):
            raise PermissionError(f"{path} is a symbolic link") from None
        raise OSError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path} is not a regular file")
        why = _why_mode(str(path), info, own=True)
        if why is not None:
            raise PermissionError(why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _import_fd(fd: int) -> Key:
    """Load the open file ``fd`` as the extension (the dynamic loader maps that very file)."""
    origin = f"/proc/self/fd/{fd}"
    loader = importlib.machinery.ExtensionFileLoader(MODULE, origin)
    spec = importlib.util.spec_from_file_location(MODULE, origin, loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {origin}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    key: Key = module.key
    return key


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


def load(folder: str | os.PathLike[str] | None = None) -> Key | None:
    """The key function of an existing build that passes the checks and its self-test, else
    None (and the reason in ``status()``, warned once). Never builds; one stat when there is
    nothing to load."""
    path = library_path(folder)
    with _state_lock:
        if str(path) in _loaded:
            return _loaded[str(path)]
    if not os.path.lexists(path):
        return None
    key: Key | None = None
    try:
        fd = _open_trusted(path)
    except OSError as exc:  # PermissionError: a refusal; another OSError: cannot read it
        why: str | None = str(exc) if isinstance(exc, PermissionError) else exc.strerror
        why = why or str(exc)
    else:
        with _state_lock:
            _kept_open.append(fd)  # its number must never name another file in this process
        try:
            key = _import_fd(fd)
        except Exception as exc:  # a damaged or foreign file at our path
            why = f"{path} does not load: {type(exc).__name__}: {exc}"
        else:
            why = _self_test(key)
    root = str(path.parent.parent)
    with _state_lock:
        if why is not None or key is None:
            why = why or "no key"
            if _status.get(root) != f"refused: {why}":
                log.warning("fp4select: not using the native warm-path key: %s", why)
            _status[root] = f"refused: {why}"
            return None
        _loaded[str(path)] = key
        _status[root] = "loaded"
    return key


def for_settings(settings: Settings) -> Key | None:
    """The key best_mm_fp4's warm path uses under ``settings``: an existing, trusted build
    under ``native="auto"``, else None (the Python path). Never builds, never raises."""
    if settings.native == "off":
        return None
    try:
        return load(settings.native_dir)
    except Exception as exc:  # an unreadable folder, a torch without its headers: Python path
        log.warning("fp4select: the native warm-path key is not used: %s", exc)
        return None


def status(folder: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What doctor and ``fp4select native`` print: the path, whether it is built, and what
    happened to it in this process."""
    path = library_path(folder)
    with _state_lock:
        happened = _status.get(str(path.parent.parent))
    built = os.path.lexists(path)
    return {
        "path": str(path),
        "built": built,
        "loaded": str(path) in _loaded,
        "status": happened or ("built, not loaded yet" if built else "not built"),
    }
