"""Building the warm path's C++ key (fp4select.native_key says what it is and how it is loaded).

Design rules:

* Deploy time only. ``fp4select native --build`` and ``fp4select warm`` call ``build``;
  nothing on best_mm_fp4's path imports this module, so a serving process never starts a
  compiler (a compiler left running after its process exits, installing a library behind
  it, was the reason).
* Builds are atomic and shared: one process compiles at a time (a file lock); the compiler
  writes a temporary file that is renamed into place, so a reader never sees half a library,
  and a failed build leaves nothing behind. The folders are made this user's alone (0700) and
  checked as the loader checks them before anything is written there.
* A failure raises ``RuntimeError`` saying why (no compiler, a refused folder, the compiler's
  last lines, a library that fails its checks or self-test); the Python path serves meanwhile.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from packaging.version import Version

from fp4select import native_key
from fp4select.native_key import SOURCE, Key, library_path

__all__ = ["BUILD_TIMEOUT_S", "build"]

BUILD_TIMEOUT_S = 600.0
_LOCK_TIMEOUT_S = BUILD_TIMEOUT_S + 60.0


def _compiler() -> list[str]:
    """$CXX (split as a shell would: ``ccache g++``), else the first C++ compiler on PATH."""
    chosen = shlex.split(os.environ.get("CXX") or "")
    if chosen:
        return chosen
    return [next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), "c++")]


def cxx_standard(torch_version: str = torch.__version__) -> str:
    """The C++ standard torch's own extension builder uses: C++20 from torch 2.12, whose
    headers need it (2.15's use ``requires`` clauses; 2.14's refuse anything older), C++17
    before."""
    release = Version(torch_version).release
    return "c++20" if release >= (2, 12) else "c++17"


def _compile_command(source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [*_compiler(), "-O2", f"-std={cxx_standard()}", "-shared", "-fPIC", abi]
    command += ["-fvisibility=hidden"]
    command += [f"-I{p}" for p in cpp_extension.include_paths()]
    command += [f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(target)]
    command += [f"-L{lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    command += [f"-Wl,-rpath,{lib_dir}"]
    if sys.platform == "darwin":  # Python's symbols come from the interpreter that loads it
        command += ["-undefined", "dynamic_lookup"]
    return command


def build(folder: str | os.PathLike[str] | None = None) -> Key:
    """Compile the key for this torch and Python (unless built already) and load it; a failure
    is a ``RuntimeError`` saying why (see the module's rules)."""
    from filelock import FileLock, Timeout

    path = library_path(folder)
    key = native_key.load(folder)
    if key is not None:
        return key
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the native key is built and loaded on Linux only")
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    why = native_key.why_untrusted_folder(path.parent, own_levels=2)
    if why is not None:
        raise RuntimeError(f"will not build in {path.parent}: {why}")
    try:
        with FileLock(str(path.parent / "build.lock"), timeout=_LOCK_TIMEOUT_S):
            if not os.path.lexists(path):  # another process may have built it meanwhile
                _compile(path)
    except Timeout:
        raise RuntimeError(f"another process held {path.parent}/build.lock too long") from None
    key = native_key.load(folder)
    if key is None:
        status = native_key.status(folder)["status"]
        raise RuntimeError(f"built {path}, but it is not usable: {status}")
    return key


# The compiler's output is made this user's alone and renamed into place by the same shell
# that ran the compiler, so a command interrupted mid-build still leaves a whole library or
# nothing.
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
