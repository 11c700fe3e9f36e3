"""What an entry and a blacklist record are on disk: the two ``RecordKind``s of the store.

Every file carries ``{"schema", "kind": "fp4select.<entry|blacklist>", "env_hash", "env"}``
so each is self-describing; an entry also holds its ``key`` and ``record``, a blacklist file
its ``backend`` and ``record``.  A read checks that the file answers the question asked
(right kind, environment and key or backend); blacklist records are checked field by field,
by the same function that normalizes them before they are written or imported.

Blacklist: per environment, one file per backend (last writer wins), so concurrent additions
of different backends cannot lose each other.  Names that are not safe lowercase file names
get a sanitized name plus a hash suffix.  Numerical rejections of one (backend, key) belong
in that key's entry, not here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from ._jsonfile import check_header, digest, digest_or_none, json_type

KIND_ENTRY: Final = "fp4select.entry"
KIND_BLACKLIST: Final = "fp4select.blacklist"
_SAFE_BACKEND = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_UNSAFE_CHARS = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True)
class RecordKind:
    """What tells one collection from another: where its files live and how they are checked.

    ``check(obj, env_hash, stem)`` says why a decoded file is not a record of this kind for
    that environment and file stem, or returns None.
    """

    kind: str
    folder: str
    pattern: re.Pattern[str]
    check: Callable[[dict[str, Any], str, str], str | None]


def as_dict(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``value`` as a dict; ``TypeError`` naming ``what`` if it is not a mapping."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping, not {type(value).__name__}")
    return value if isinstance(value, dict) else dict(value)


def hash_of(value: Mapping[str, Any], what: str) -> str:
    """The digest naming ``value`` (an env or a key) on disk."""
    return digest(as_dict(value, what))


def backend_file_name(backend: str) -> str:
    """The file stem of ``backend``'s blacklist record."""
    if _SAFE_BACKEND.fullmatch(backend):
        return backend
    cleaned = _UNSAFE_CHARS.sub("_", backend.lower()).strip("._-")[:40] or "backend"
    return f"{cleaned}-{digest(backend)[:12]}"


def blacklist_record(backend: Any, record: Mapping[str, Any]) -> dict[str, Any]:
    """Normalize a blacklist record; reject early what would make an unreadable file later."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty string, not {backend!r}")
    out = dict(as_dict(record, "blacklist record"))
    if out.setdefault("backend", backend) != backend:
        raise ValueError(f"record names backend {out['backend']!r}, not {backend!r}")
    for field in ("reason", "kind"):
        if not isinstance(out.get(field), str):
            raise ValueError(f"blacklist record for {backend!r} needs a string {field!r}")
    when = out.setdefault("when", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    try:
        datetime.fromisoformat(when)
    except (TypeError, ValueError):
        raise ValueError(
            f"blacklist record for {backend!r}: 'when' must be an ISO 8601 string, not {when!r}"
        ) from None
    for field in ("key", "detail"):
        value = out.get(field)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"blacklist record for {backend!r}: {field!r} must be a mapping")
            out[field] = dict(value)
    scope = out.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise ValueError(f"blacklist record for {backend!r}: 'scope' must be a string")
    if scope == "key" and out.get("key") is None:
        raise ValueError(f"blacklist record for {backend!r}: scope 'key' needs a 'key' mapping")
    return out


def _check_entry(obj: dict[str, Any], env_hash: str, key_hash: str) -> str | None:
    problem = check_header(obj, KIND_ENTRY, env_hash)
    if problem is not None:
        return problem
    key = obj.get("key")
    if not isinstance(key, dict):
        return f"'key' must be a JSON object, found {json_type(key)}"
    if digest_or_none(key) != key_hash:
        return f"its key does not match the requested key {key_hash}"
    if not isinstance(obj.get("record"), dict):
        return f"'record' must be a JSON object, found {json_type(obj.get('record'))}"
    return None


def _check_blacklist(obj: dict[str, Any], env_hash: str, file_name: str) -> str | None:
    problem = check_header(obj, KIND_BLACKLIST, env_hash)
    if problem is not None:
        return problem
    backend = obj.get("backend")
    if not isinstance(backend, str) or not backend:
        return "'backend' must be a non-empty string"
    if backend_file_name(backend) != file_name:
        return f"backend {backend!r} does not belong in this file"
    record = obj.get("record")
    if not isinstance(record, dict):
        return f"'record' must be a JSON object, found {json_type(record)}"
    if record.get("backend") != backend:
        return "its record names another backend"
    try:
        blacklist_record(backend, record)
    except ValueError as exc:
        return str(exc)
    return None


ENTRIES: Final = RecordKind(
    KIND_ENTRY, "entries", re.compile(r"([0-9a-f]{20})\.json"), _check_entry
)
BLACKLIST: Final = RecordKind(
    KIND_BLACKLIST, "blacklist", re.compile(r"([a-z0-9][a-z0-9._-]*)\.json"), _check_blacklist
)
