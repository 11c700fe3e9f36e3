"""Every ``FP4SELECT_*`` environment variable, declared once: name, type, default, meaning.

Design rules:

* One table, ``VARIABLES``, names each variable with its default as the README shows it and
  its meaning; ``Settings.from_env`` parses from it and ``markdown_table()`` prints it, and a
  test checks that README.md's "Configuration" table is exactly that output. A new variable
  is one row here and one field of ``Settings``.
* ``Settings`` is frozen and checked on construction: a bad value is a ``ValueError`` that
  names the field (or, read from the environment, the variable) and what was expected.
* The process-wide settings (``current()``) are read once, on first use, from the
  environment; ``fp4select.configure()`` replaces them. Code that acts for a selector takes its
  ``Settings`` as an argument (the Selector, the sandbox prober, the store's location); only
  what has no selector to ask reads ``current()``: flashinfer's experimental switch and its
  tactic mode (backend functions) and the record file (the miss path of ``best_mm_fp4``).
* Sandbox workers are child processes: ``to_env()`` writes the settings back as variables for
  the child's environment, so what ``configure()`` set holds in the child as well.
* The engine plugins' four variables (``engine=True`` rows) are listed here for the README but
  read by ``fp4select.integrations._common`` when the engine loads the plugin, before anything
  of fp4select is configured, and leniently: a plugin never raises into the engine, so a bad
  value there is logged and ignored instead of raised.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["VARIABLES", "Settings", "Variable", "current", "markdown_table", "use"]

ISOLATIONS = ("subprocess", "inprocess")
BLACKLIST_SCOPES = ("environment", "key")
CHECK_MODES = ("first", "always")
TACTIC_MODES = ("tune", "default")
NATIVE_MODES = ("auto", "off")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _seconds(value: Any, what: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    return seconds


def _tactic_mode(value: Any, what: str) -> str:
    """``tune``, ``default``, or ``default:NAME[,NAME...]`` (those backends untuned only)."""
    word = value.strip() if isinstance(value, str) else value
    if isinstance(word, str) and word.lower().startswith("default:"):
        names = [n.strip() for n in word.split(":", 1)[1].split(",") if n.strip()]
        if names:
            return "default:" + ",".join(names)
    if isinstance(word, str) and word.lower() in TACTIC_MODES:
        return word.lower()
    raise ValueError(
        f"{what} must be one of {TACTIC_MODES}, got {value!r} (or 'default:' and backend "
        "names, as in 'default:cute-dsl,b12x')"
    )


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, what: str) -> str:
        word = value.strip().lower() if isinstance(value, str) else value
        if word not in choices:
            raise ValueError(f"{what} must be one of {choices}, got {value!r}")
        return word

    return parse


def _switch(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{what} must be 1 or 0 (also true/false, yes/no, on/off), got {value!r}")


def _path(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{what} must be a path, got {value!r}")
    text = os.fspath(value)
    if not isinstance(text, str) or "\0" in text:
        raise ValueError(f"{what} must be a path, got {value!r}")
    return text or None  # an empty variable means unset


def _with_default(parse: Callable[[Any, str], Any], default: str) -> Callable[[Any, str], Any]:
    """An empty or blank variable reads as unset, as it always has."""

    def read(value: Any, what: str) -> Any:
        if isinstance(value, str) and not value.strip():
            value = default
        return parse(value, what)

    return read


@dataclass(frozen=True)
class Variable:
    """One row of the README's table: the variable, its field, its default shown, its meaning."""

    env: str
    field: str | None  # the Settings field; None for the engine plugins' variables
    default: str  # as the README shows it
    meaning: str
    engine: bool = False


# Order: the README's. The meanings are the README's text (checked by tests/test_settings.py).
VARIABLES: tuple[Variable, ...] = (
    Variable(
        "FP4SELECT_CACHE_DIR",
        "cache_dir",
        "platformdirs' user cache dir for `fp4select`",
        "where decisions and the blacklist live",
    ),
    Variable(
        "FP4SELECT_ISOLATION",
        "isolation",
        "`subprocess`",
        "`inprocess` probes in the calling process (faster, for tests and users who accept the "
        "risk)",
    ),
    Variable(
        "FP4SELECT_TIME_BUDGET_S",
        "time_budget_s",
        "`3`",
        "timing budget per key, in seconds",
    ),
    Variable(
        "FP4SELECT_PROBE_TIMEOUT_S",
        "probe_timeout_s",
        "`600`",
        "a sandboxed run silent this long is a hang (JIT compilation can take minutes); the "
        "built-in `emulation` gets at least 60 s plus its problem's flops at a pessimistic rate",
    ),
    Variable(
        "FP4SELECT_WORKER_IDLE_S",
        "worker_idle_s",
        "`120`",
        "the sandbox worker exits after this long unused",
    ),
    Variable(
        "FP4SELECT_BLACKLIST_SCOPE",
        "blacklist_scope",
        "`environment`",
        "`key` blacklists a crashing backend for the crashing key only",
    ),
    Variable(
        "FP4SELECT_EXPERIMENTAL",
        "experimental",
        "unset",
        "`1` lets flashinfer's experimental backends (e.g. `cake`) compete",
    ),
    Variable(
        "FP4SELECT_CHECK",
        "check",
        "unset",
        "`always` re-checks arguments on every call, not only the first of each signature",
    ),
    Variable(
        "FP4SELECT_TACTICS",
        "tactics",
        "`tune`",
        "`default` times and serves every flashinfer backend at flashinfer's default tactic (no "
        "tuning); `default:cute-dsl,cutedsl_low_latency` does so for the backends named only",
    ),
    Variable(
        "FP4SELECT_TUNE_TIMEOUT_S",
        "tune_timeout_s",
        "`300`",
        "one backend's tactic tuning stops after this long (checked between tactics); the "
        "backend is then kept at flashinfer's default tactic, with the reason, not blacklisted",
    ),
    Variable(
        "FP4SELECT_RECORD",
        "record",
        "unset",
        "a file: append each problem key a process meets (first call of a signature only), for "
        "`warm --from-record`",
    ),
    Variable(
        "FP4SELECT_NATIVE",
        "native",
        "`auto`",
        "`auto` loads the warm path's C++ key if `fp4select warm` or `fp4select native --build` "
        "built it for this torch (a serving process never starts a compiler), else the Python "
        "path serves; `off` keeps the Python path (about 1 µs slower a call, same answers)",
    ),
    Variable(
        "FP4SELECT_NATIVE_DIR",
        "native_dir",
        "`$TORCH_EXTENSIONS_DIR/fp4select` (PyTorch's extension folder)",
        "where that C++ key is built; loaded only if it, its folders and every folder above "
        "pass the checks in docs/native_key.md",
    ),
    Variable(
        "FP4SELECT_ENGINE_PLUGIN",
        None,
        "unset",
        "`1` turns the SGLang/vLLM plugin on without the engine's allow-list, `0` off whatever "
        "the list says",
        engine=True,
    ),
    Variable(
        "FP4SELECT_ALLOW_UNTESTED_ENGINE",
        None,
        "unset",
        "`1` lets the engine plugins patch an engine version they were not tested with",
        engine=True,
    ),
    Variable(
        "FP4SELECT_WARM_AT_LOAD",
        None,
        "`1`",
        "`0`: the engine plugins do not tune at model load",
        engine=True,
    ),
    Variable(
        "FP4SELECT_WARM_MAX_M",
        None,
        "the server's largest batch",
        "lowers the largest M the engine plugins tune at load",
        engine=True,
    ),
)
_BY_FIELD = {v.field: v for v in VARIABLES if v.field is not None}

# Each field's parser; a parser takes the value and the words to name it by in an error.
_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "cache_dir": _path,
    "isolation": _with_default(_choice(ISOLATIONS), "subprocess"),
    "time_budget_s": _with_default(_seconds, "3"),
    "probe_timeout_s": _with_default(_seconds, "600"),
    "worker_idle_s": _with_default(_seconds, "120"),
    "blacklist_scope": _with_default(_choice(BLACKLIST_SCOPES), "environment"),
    "experimental": _switch,
    "check": _with_default(_choice(CHECK_MODES), "first"),
    "tactics": _with_default(_tactic_mode, "tune"),
    "tune_timeout_s": _with_default(_seconds, "300"),
    "record": _path,
    "native": _with_default(_choice(NATIVE_MODES), "auto"),
    "native_dir": _path,
}


@dataclass(frozen=True)
class Settings:
    """What fp4select's environment variables say, typed; see ``VARIABLES`` for each one."""

    cache_dir: str | None = None
    isolation: str = "subprocess"
    time_budget_s: float = 3.0
    probe_timeout_s: float = 600.0
    worker_idle_s: float = 120.0
    blacklist_scope: str = "environment"
    experimental: bool = False
    check: str = "first"
    tactics: str = "tune"
    tune_timeout_s: float = 300.0
    record: str | None = None
    native: str = "auto"
    native_dir: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = _PARSERS[f.name](getattr(self, f.name), f.name)
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings ``environ`` (default ``os.environ``) gives; unset variables, defaults.

        A bad value raises ``ValueError`` naming the variable and what it must be.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in _BY_FIELD.items():
            raw = environ.get(variable.env)
            if raw is not None:
                values[name] = _PARSERS[name](raw, variable.env)
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``; an unknown name is a ``TypeError`` that lists the known."""
        unknown = sorted(set(changes) - set(_PARSERS))
        if unknown:
            raise TypeError(
                f"unknown setting(s) {', '.join(unknown)}; the settings are {sorted(_PARSERS)}"
            )
        return replace(self, **changes)

    def to_env(self) -> dict[str, str | None]:
        """These settings as environment variables (None: unset it), for a child process."""
        out: dict[str, str | None] = {}
        for name, variable in _BY_FIELD.items():
            value = getattr(self, name)
            if value is None:
                out[variable.env] = None
            elif isinstance(value, bool):
                out[variable.env] = "1" if value else "0"
            else:
                out[variable.env] = str(value)
        return out


def markdown_table() -> str:
    """The README's "Configuration" table, one row per variable."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.env}` | {v.default} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines)


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The process-wide settings: read from the environment on first use, or as configured."""
    global _current
    settings = _current
    if settings is None:
        with _lock:
            if _current is None:
                _current = Settings.from_env()
            settings = _current
    return settings


def use(settings: Settings | None) -> None:
    """Make ``settings`` the process-wide settings; None reads the environment again on next use.

    ``fp4select.configure()`` calls this; tests call ``use(None)`` to start from the environment.
    """
    global _current
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"settings must be a Settings or None, got {type(settings).__name__}")
    with _lock:
        _current = settings
