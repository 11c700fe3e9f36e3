"""One JSON file at a time: strict decoding, content hashes, guarded reads, atomic writes.

Nothing here knows what a file means; the store decides that.  The rules kept:

- Strict JSON only.  Nothing read is imported or executed; parsing refuses NaN, Infinity and
  floats that overflow to infinity (Python's json accepts all three), and nesting deeper than
  ``MAX_DEPTH`` (it would break every recursive reader, such as ``explain``).  Encoding
  refuses them too, so what is written can always be read back.
- ``digest(obj)`` is the first 20 hex digits of the sha256 of the canonical JSON
  (``sort_keys=True, separators=(",", ":")``, ASCII, no NaN or infinity): dict order never
  matters, tuples and lists hash alike.  Changing it orphans every cache; a test freezes it.
- Only regular files are read, of bounded size, opened with ``O_NONBLOCK | O_NOFOLLOW``: a
  FIFO cannot block, a symlink to ``/dev/zero`` is never followed.  Anything else at a path
  is ``Damage``: never read, followed or deleted.
- Writes are atomic: a temp file in the same directory (``mkstemp``, named ``.*``),
  ``fsync``, then ``os.replace`` (or an exclusive hard link that never replaces a name).  A
  reader sees the old file or the new one, never half; temp files are removed on any failure.
  The directory is not fsynced: after a power cut a file may be missing, which is a miss.
- ``remove`` unlinks a name (a symlink or FIFO goes as a name, its target stays) and never a
  directory: there is no recursive delete anywhere in the store.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

SCHEMA_VERSION: Final[int] = 1
MAX_FILE_BYTES: Final = 1 << 20  # an entry, blacklist or env file; real ones are a few KiB
# Deepest nesting read: fp4select writes about 8 levels (an archive's entry's record's
# verdict's detail's tactic ...); 32 leaves room for tactic records and refuses the rest.
MAX_DEPTH: Final = 32
_DIGEST_CHARS: Final = 20
# O_NONBLOCK: opening a FIFO must not wait for a writer.  O_NOFOLLOW: a symlink is refused by
# the kernel, closing the gap between the lstat check and the open where the flag exists.
_READ_FLAGS: Final = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


# --------------------------------------------------------------------------- encoding


def _canonical(obj: Any) -> str:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def digest(obj: Any) -> str:
    """Name a JSON-able value by content, so equal dicts share a file whatever their order.

    Raises ``TypeError`` for values JSON cannot hold and ``ValueError`` for NaN or infinity.
    """
    return hashlib.sha256(_canonical(obj).encode("ascii")).hexdigest()[:_DIGEST_CHARS]


def digest_or_none(obj: Any) -> str | None:
    """``digest(obj)``, or None for a value that is not strict JSON."""
    try:
        return digest(obj)
    except (TypeError, ValueError, RecursionError):
        return None


def file_bytes(obj: Mapping[str, Any]) -> bytes:
    """The bytes of a file holding ``obj``; raises for what is not strict JSON."""
    # Indented for people reading the cache; ASCII so any lone surrogate survives encoding.
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)
    return (text + "\n").encode("ascii")


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


class _NotStrictJSON(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotStrictJSON(f"holds {name}, which strict JSON does not allow")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to infinity without ever saying "Infinity"
        raise _NotStrictJSON(f"holds {text}, which is not a finite number")
    return value


def decode(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """Parse one file as strict JSON (no NaN or infinity, which Python's json accepts);
    a problem comes back as text because it becomes a warning or an error."""
    if not data.strip():
        return None, "empty file"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        return None, "JSON nested too deeply"
    except _NotStrictJSON as exc:
        return None, str(exc)
    except ValueError as exc:
        return None, f"not valid JSON, truncated or corrupt ({exc})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, found {json_type(obj)}"
    if too_deep(obj):
        return None, f"JSON nested deeper than {MAX_DEPTH} levels"
    return obj, None


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``obj`` nests dicts and lists deeper than ``limit`` (told without recursion)."""
    todo = [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value
        if not isinstance(value, (dict, list)):
            continue
        if depth > limit:
            return True
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


# --------------------------------------------------------------------------- reading


class Damage(OSError):
    """Something at one of our paths that fp4select never creates there.

    A directory, a symlink, a FIFO, a device, or a file larger than anything it writes: such a
    thing is not ours, so it is never read, followed or deleted, only reported.
    """


def what(mode: int) -> str:
    """Name the kind of file ``mode`` describes, for messages."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _read_fd(fd: int, path: Path, limit: int) -> bytes:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise Damage(errno.EINVAL, f"it is {what(info.st_mode)}, not a regular file", str(path))
    if info.st_size > limit:
        raise Damage(errno.EFBIG, f"it is larger than {limit} bytes", str(path))
    data = bytearray()
    while len(data) <= limit:  # the size may have grown since fstat
        chunk = os.read(fd, limit + 1 - len(data))
        if not chunk:
            return bytes(data)
        data += chunk
    raise Damage(errno.EFBIG, f"it is larger than {limit} bytes", str(path))


def read_file(path: Path, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of the regular file at ``path``, None when nothing is there.

    Anything else raises: ``Damage`` for what fp4select never writes (a FIFO would block every
    lookup, a symlink to ``/dev/zero`` would never end), ``OSError`` when it cannot be read.
    """
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        # NotADirectoryError: a parent is a file, so nothing of ours is here; a write reports it.
        return None
    if not stat.S_ISREG(info.st_mode):
        raise Damage(errno.EINVAL, f"it is {what(info.st_mode)}, not a regular file", str(path))
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symlink made just now
            raise Damage(exc.errno, "it is a symbolic link", str(path)) from None
        raise
    try:
        return _read_fd(fd, path, limit)
    finally:
        os.close(fd)


def read_named_file(path: Path, limit: int) -> bytes:
    """A file the user named: symlinks are followed (the user chose the path), but only a
    regular file of at most ``limit`` bytes is read (``Damage`` otherwise)."""
    fd = os.open(path, _READ_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    try:
        return _read_fd(fd, path, limit)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- writing


def remove(path: Path) -> bool:
    """Unlink the name at ``path``; True if there was one.  A directory is not ours: it stays."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISDIR(info.st_mode):
        raise Damage(
            errno.EISDIR, "it is a directory, which fp4select never makes there", str(path)
        )
    try:
        os.unlink(path)  # a symlink or FIFO goes as a name; what it points at is untouched
    except FileNotFoundError:
        return False
    return True


def atomic_write(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` so that a reader sees the old file or the new one, never half of one.

    ``replace=False`` claims the name atomically and raises ``FileExistsError`` if anything is
    there.  A directory at ``path`` is never replaced: that raises ``Damage``.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            if hasattr(os, "fchmod"):  # mkstemp's 0o600 would hide a shared cache from others
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            if os.path.isdir(path) and not os.path.islink(path):
                raise Damage(
                    errno.EISDIR, "a directory is in the way; it is left as it is", str(path)
                )
            os.replace(tmp, path)  # onto a directory this fails (EISDIR): never destructive
        else:
            _link_exclusive(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _link_exclusive(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)  # fails with EEXIST if anything, even a dangling symlink, is there
    except FileExistsError:
        raise
    except OSError:
        # No hard links on this file system: claim the name with O_EXCL, then move onto it.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        os.close(os.open(path, flags, 0o644))
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the empty placeholder made just above
            raise
        return
    with contextlib.suppress(OSError):
        os.unlink(tmp)


# --------------------------------------------------------------------------- headers


def check_header(obj: dict[str, Any], kind: str, env_hash: str) -> str | None:
    """Why ``obj`` is not a file of ``kind`` for ``env_hash``, or None."""
    # Schema first: a newer fp4select may have changed everything else.
    schema = obj.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        return f"schema {schema!r} is not {SCHEMA_VERSION} (written by another fp4select version?)"
    if obj.get("kind") != kind:
        return f"kind {obj.get('kind')!r} is not {kind!r}"
    if obj.get("env_hash") != env_hash:
        return f"env_hash {obj.get('env_hash')!r} is not the requested environment {env_hash}"
    env = obj.get("env")
    if not isinstance(env, dict):
        return f"'env' must be a JSON object, found {json_type(env)}"
    if digest_or_none(env) != env_hash:
        return "its 'env' does not hash to its env_hash"
    return None
