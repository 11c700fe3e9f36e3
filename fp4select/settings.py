"""Every ``FP4SELECT_*`` environment variable, declared once: name, parser, typed default, meaning.

Design rules:

* One declaration per variable, as Triton's ``knobs`` do: a ``Settings`` field is declared
  with ``_setting(variable, default, parser, shown default, meaning)``, and ``VARIABLES``, the
  README's table (``markdown_table()``, checked against README.md by a test), ``from_env``,
  ``replace``, ``to_env`` and ``configure(**changes)`` are all read off those fields. The engine
  plugins' variables are rows of the same table (``ENGINE_VARIABLES``), parsed by the same
  parsers (``engine_setting``). A new variable is one field here.
* ``Settings`` is frozen and checked on construction: a bad value is a ``SettingError`` (a
  ``ValueError``) whose ``variable`` is the field's name, or, read from the environment, the
  variable's, and whose message names it and says what was expected. An empty or blank
  variable reads as unset (a path: an empty one only).
* The process-wide settings (``current()``) are read once, on first use, from the
  environment; ``fp4select.configure()`` replaces them. Code that acts for a selector takes its
  ``Settings`` as an argument (the Selector, the sandbox prober, the store's location); only
  what has no selector to ask reads ``current()``: flashinfer's experimental switch and its
  tactic mode (backend functions) and the record file (the miss path of ``best_mm_fp4``).
* Sandbox workers are child processes: ``to_env()`` writes the settings back as variables for
  the child's environment, so what ``configure()`` set holds in the child as well.
* The engine plugins' variables are read by ``engine_setting`` each time a plugin asks (the
  engine loads the plugin before anything of fp4select is configured), and leniently: a plugin
  never raises into the engine, so a bad value there is logged and the default used.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

__all__ = [
    "ENGINE_VARIABLES",
    "VARIABLES",
    "SettingError",
    "Settings",
    "Variable",
    "current",
    "engine_setting",
    "markdown_table",
    "use",
]

log = logging.getLogger("fp4select")

Isolation = Literal["subprocess", "inprocess"]
ISOLATIONS: tuple[Isolation, ...] = ("subprocess", "inprocess")
BLACKLIST_SCOPES = ("environment", "key")
CHECK_MODES = ("first", "always")
TACTIC_MODES = ("tune", "default")
NATIVE_MODES = ("auto", "off")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class SettingError(ValueError):
    """A setting has a value it cannot take. ``variable`` names it: the environment variable
    when it was read from one, else the ``Settings`` field (``configure``'s keyword); the
    message starts with that name and says what the value must be."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable


def _seconds(value: Any, what: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise SettingError(what, f"{what} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise SettingError(what, f"{what} must be a positive number of seconds, got {value!r}")
    return seconds


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, what: str) -> str:
        word = value.strip().lower() if isinstance(value, str) else value
        if word not in choices:
            raise SettingError(what, f"{what} must be one of {choices}, got {value!r}")
        return word

    return parse


def _tactic_mode(value: Any, what: str) -> str:
    """``tune``, ``default``, or ``default:NAME[,NAME...]`` (those backends untuned only)."""
    word = value.strip() if isinstance(value, str) else value
    if isinstance(word, str) and word.lower().startswith("default:"):
        names = [n.strip() for n in word.split(":", 1)[1].split(",") if n.strip()]
        if names:
            return "default:" + ",".join(names)
    if isinstance(word, str) and word.lower() in TACTIC_MODES:
        return word.lower()
    raise SettingError(
        what,
        f"{what} must be one of {TACTIC_MODES}, got {value!r} (or 'default:' and backend "
        "names, as in 'default:cute-dsl,b12x')",
    )


def _switch(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise SettingError(
        what, f"{what} must be 1 or 0 (also true/false, yes/no, on/off), got {value!r}"
    )


def _path(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise SettingError(what, f"{what} must be a path, got {value!r}")
    text = os.fspath(value)
    if not isinstance(text, str) or "\0" in text:
        raise SettingError(what, f"{what} must be a path, got {value!r}")
    return text or None  # an empty variable means unset


def _positive_int(value: Any, what: str) -> int:
    try:
        number = int(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1:
        raise SettingError(what, f"{what} must be a positive integer, got {value!r}")
    return number


@dataclass(frozen=True)
class Variable:
    """One ``FP4SELECT_*`` variable: a row of the README's table, and how to read it."""

    env: str
    field: str | None  # the Settings field; None for the engine plugins' variables
    default: Any  # the typed value when unset
    parse: Callable[[Any, str], Any]
    shown: str  # the default as the README shows it
    meaning: str  # the README's text (checked by tests/test_settings.py)
    engine: bool = False

    def read(self, value: Any, what: str | None = None) -> Any:
        """``value`` parsed; None, or an empty (or, but for a path, blank) string, is unset.

        A bad value is a ``SettingError`` naming ``what`` (by default the variable).
        """
        blank = isinstance(value, str) and not value.strip()
        if value is None or (blank and not (self.parse is _path and value)):
            return self.default
        return self.parse(value, what or self.env)


def _setting(
    env: str, default: Any, parse: Callable[[Any, str], Any], shown: str, meaning: str
) -> Any:
    """A ``Settings`` field declared with its variable (kept in the field's metadata)."""
    row = Variable(env, None, default, parse, shown, meaning)
    return field(default=default, metadata={"variable": row})


@dataclass(frozen=True)
class Settings:
    """What fp4select's environment variables say, typed: one field per variable.

    Order: the README's. Each field is its variable's one declaration (see the module rules).
    """

    cache_dir: str | None = _setting(
        "FP4SELECT_CACHE_DIR",
        None,
        _path,
        "platformdirs' user cache dir for `fp4select`",
        "where decisions and the blacklist live",
    )
    isolation: Isolation = _setting(
        "FP4SELECT_ISOLATION",
        "subprocess",
        _choice(ISOLATIONS),
        "`subprocess`",
        "`inprocess` probes in the calling process (faster, for tests and users who accept the "
        "risk)",
    )
    time_budget_s: float = _setting(
        "FP4SELECT_TIME_BUDGET_S", 3.0, _seconds, "`3`", "timing budget per key, in seconds"
    )
    probe_timeout_s: float = _setting(
        "FP4SELECT_PROBE_TIMEOUT_S",
        600.0,
        _seconds,
        "`600`",
        "a sandboxed run silent this long is a hang (JIT compilation can take minutes); the "
        "built-in `emulation` gets at least 60 s plus its problem's flops at a pessimistic rate",
    )
    worker_idle_s: float = _setting(
        "FP4SELECT_WORKER_IDLE_S",
        120.0,
        _seconds,
        "`120`",
        "the sandbox worker exits after this long unused",
    )
    blacklist_scope: str = _setting(
        "FP4SELECT_BLACKLIST_SCOPE",
        "environment",
        _choice(BLACKLIST_SCOPES),
        "`environment`",
        "`key` blacklists a crashing backend for the crashing key only",
    )
    experimental: bool = _setting(
        "FP4SELECT_EXPERIMENTAL",
        False,
        _switch,
        "unset",
        "`1` lets flashinfer's experimental backends (e.g. `cake`) compete",
    )
    check: str = _setting(
        "FP4SELECT_CHECK",
        "first",
        _choice(CHECK_MODES),
        "unset",
        "`always` re-checks arguments on every call, not only the first of each signature",
    )
    tactics: str = _setting(
        "FP4SELECT_TACTICS",
        "tune",
        _tactic_mode,
        "`tune`",
        "`default` times and serves every backend that has tactics (flashinfer's and the "
        "`hopper-*` kernels) at its default (no tuning); `default:cute-dsl,hopper-mma` does so "
        "for the backends named only",
    )
    tune_timeout_s: float = _setting(
        "FP4SELECT_TUNE_TIMEOUT_S",
        300.0,
        _seconds,
        "`300`",
        "one backend's tactic tuning stops after this long (checked between tactics); the "
        "backend is then kept at flashinfer's default tactic, with the reason, not blacklisted",
    )
    record: str | None = _setting(
        "FP4SELECT_RECORD",
        None,
        _path,
        "unset",
        "a file: append each problem key a process meets (first call of a signature only), for "
        "`warm --from-record`",
    )
    native: str = _setting(
        "FP4SELECT_NATIVE",
        "auto",
        _choice(NATIVE_MODES),
        "`auto`",
        "`auto` loads the warm path's C++ key if `fp4select warm` or `fp4select native --build` "
        "built it for this torch (a serving process never starts a compiler), else the Python "
        "path serves; `off` keeps the Python path (about 1 µs slower a call, same answers)",
    )
    native_dir: str | None = _setting(
        "FP4SELECT_NATIVE_DIR",
        None,
        _path,
        "`$TORCH_EXTENSIONS_DIR/fp4select` (PyTorch's extension folder)",
        "where that C++ key is built; loaded only if it, its folders and every folder above "
        "pass the checks in docs/native_key.md",
    )

    def __post_init__(self) -> None:
        for name, variable in _BY_FIELD.items():
            object.__setattr__(self, name, variable.read(getattr(self, name), name))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings ``environ`` (default ``os.environ``) gives; unset variables, defaults.

        A bad value raises ``SettingError`` naming the variable and what it must be.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in _BY_FIELD.items():
            raw = environ.get(variable.env)
            if raw is not None:
                values[name] = variable.read(raw)
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``; an unknown name is a ``TypeError`` that lists the known."""
        unknown = sorted(set(changes) - set(_BY_FIELD))
        if unknown:
            raise TypeError(
                f"unknown setting(s) {', '.join(unknown)}; the settings are {sorted(_BY_FIELD)}"
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


# The fields' variables, with their field names filled in: field name -> row.
_BY_FIELD: dict[str, Variable] = {
    f.name: replace(f.metadata["variable"], field=f.name) for f in fields(Settings)
}

# The engine plugins' variables: read when the engine asks, by ``engine_setting``.
ENGINE_VARIABLES: tuple[Variable, ...] = (
    Variable(
        "FP4SELECT_ENGINE_PLUGIN",
        None,
        None,  # unset: the engine's own allow-list decides
        _switch,
        "unset",
        "`1` turns the SGLang/vLLM plugin on without the engine's allow-list, `0` off whatever "
        "the list says",
        engine=True,
    ),
    Variable(
        "FP4SELECT_ALLOW_UNTESTED_ENGINE",
        None,
        False,
        _switch,
        "unset",
        "`1` lets the engine plugins patch an engine version they were not tested with",
        engine=True,
    ),
    Variable(
        "FP4SELECT_WARM_AT_LOAD",
        None,
        True,
        _switch,
        "`1`",
        "`0`: the engine plugins do not tune at model load",
        engine=True,
    ),
    Variable(
        "FP4SELECT_WARM_MAX_M",
        None,
        None,  # unset: the server's largest batch
        _positive_int,
        "the server's largest batch",
        "lowers the largest M the engine plugins tune at load",
        engine=True,
    ),
)
_ENGINE = {v.env: v for v in ENGINE_VARIABLES}

# Order: the README's.
VARIABLES: tuple[Variable, ...] = (*_BY_FIELD.values(), *ENGINE_VARIABLES)


def engine_setting(env: str, environ: Mapping[str, str] | None = None) -> Any:
    """The engine variable ``env`` as its row reads it now; a bad value is logged, and the
    default used (a plugin never raises into the engine)."""
    variable = _ENGINE[env]
    raw = (os.environ if environ is None else environ).get(env)
    try:
        return variable.read(raw)
    except SettingError as exc:
        log.warning("fp4select: ignoring %s (the default is used)", exc)
        return variable.default


def markdown_table() -> str:
    """The README's "Configuration" table, one row per variable."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.env}` | {v.shown} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines)


def untuned_by_setting(mode: str, name: str | None) -> bool:
    """Whether ``FP4SELECT_TACTICS`` (``tune``, ``default`` or ``default:a,b``) spares ``name``."""
    if mode == "default":
        return True
    if mode.startswith("default:"):
        return name is not None and name in mode.split(":", 1)[1].split(",")
    return False


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
