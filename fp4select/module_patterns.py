"""Module-name patterns from a checkpoint's quantization config, matched without backtracking.

Design rules:

* A model's config is input from the internet, and its ``re:`` patterns (compressed-tensors,
  ModelOpt) are Python regular expressions: Python's ``re`` backtracks, so one pattern such as
  ``re:([a-z_.0-9]+)+!`` took exponential time on a module name and hung ``warm --model``.
  Here a pattern is parsed by Python's own parser (so it means what ``re.match`` means) and
  run as a Thompson NFA: the set of states advances one character at a time, so a match costs
  at most (name length) x (pattern size) steps, whatever the pattern. No timeout is needed.
* What such configs use is supported: literals, ``.``, classes (``[a-z]``, ``\\d``, ``\\w``,
  ``\\s`` and negations), groups, alternation, ``* + ? {m,n}`` (greedy or lazy: the same for a
  yes/no answer), ``^`` ``$`` ``\\A`` ``\\Z``. What needs backtracking or cannot be bounded
  (back-references, look-around, conditionals, word boundaries, inline flags) is refused
  with ``PatternError`` naming the pattern and the construct; so is a pattern longer than
  ``MAX_PATTERN`` characters or one whose counted repeats expand past ``MAX_STATES`` states.
* Semantics are ``re.match``'s: anchored at the start, a match of any prefix counts (``$``
  anchors the end).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

try:  # Python's own regular-expression parser: re._parser (3.11+), sre_parse before
    _p: Any = importlib.import_module("re._parser")
    _c: Any = importlib.import_module("re._constants")
except ImportError:  # pragma: no cover - Python 3.10
    _p = importlib.import_module("sre_parse")
    _c = importlib.import_module("sre_constants")

__all__ = ["MAX_PATTERN", "MAX_STATES", "PatternError", "compile_pattern"]

MAX_PATTERN = 1000  # characters; real patterns are tens
MAX_STATES = 20000  # NFA states after expanding {m,n}


class PatternError(ValueError):
    """A pattern this matcher refuses (the message names the construct)."""


_Char = Callable[[int], bool]


def _category(name: str) -> _Char:
    def digit(c: int) -> bool:
        return chr(c).isdecimal()

    def word(c: int) -> bool:
        return chr(c).isalnum() or c == 95

    def space(c: int) -> bool:
        return chr(c).isspace()

    table: dict[str, _Char] = {
        "CATEGORY_DIGIT": digit,
        "CATEGORY_NOT_DIGIT": lambda c: not digit(c),
        "CATEGORY_WORD": word,
        "CATEGORY_NOT_WORD": lambda c: not word(c),
        "CATEGORY_SPACE": space,
        "CATEGORY_NOT_SPACE": lambda c: not space(c),
    }
    if name not in table:
        raise PatternError(f"the class {name} is not supported")
    return table[name]


def _equal(value: int) -> _Char:
    return lambda c: c == value


def _within(lo: int, hi: int) -> _Char:
    return lambda c: lo <= c <= hi


def _char_class(items: list[tuple[Any, Any]]) -> _Char:
    negate = False
    tests: list[_Char] = []
    for op, av in items:
        kind = str(op)
        if kind == "NEGATE":
            negate = True
        elif kind == "LITERAL":
            tests.append(_equal(av))
        elif kind == "RANGE":
            tests.append(_within(av[0], av[1]))
        elif kind == "CATEGORY":
            tests.append(_category(str(av)))
        else:
            raise PatternError(f"{kind} inside a character class is not supported")
    if negate:
        return lambda c: not any(t(c) for t in tests)
    return lambda c: any(t(c) for t in tests)


class _Nfa:
    """States: ("char", test, next), ("split", a, b), ("begin"|"end", next), ("match",)."""

    def __init__(self) -> None:
        self.states: list[list[Any]] = []

    def add(self, *state: Any) -> int:
        if len(self.states) >= MAX_STATES:
            raise PatternError(f"it expands past {MAX_STATES} states")
        self.states.append(list(state))
        return len(self.states) - 1

    def build(self, items: Any, then: int) -> int:
        """States matching the sequence ``items`` and continuing at ``then``; returns the entry."""
        entry = then
        for op, av in reversed(list(items)):
            entry = self.one(str(op), av, entry)
        return entry

    def one(self, kind: str, av: Any, then: int) -> int:
        if kind == "LITERAL":
            return self.add("char", lambda c, v=av: c == v, then)
        if kind == "NOT_LITERAL":
            return self.add("char", lambda c, v=av: c != v, then)
        if kind == "ANY":
            return self.add("char", lambda c: c != 10, then)
        if kind == "IN":
            return self.add("char", _char_class(av), then)
        if kind == "SUBPATTERN":
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise PatternError("inline flags are not supported")
            return self.build(sub, then)
        if kind == "BRANCH":
            entries = [self.build(alt, then) for alt in av[1]]
            entry = entries[-1]
            for alt in reversed(entries[:-1]):
                entry = self.add("split", alt, entry)
            return entry
        if kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            return self.repeat(av, then)
        if kind == "AT":
            at = str(av)
            if at in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                return self.add("begin", then)
            if at in ("AT_END", "AT_END_STRING"):
                return self.add("end", then)
            raise PatternError(f"the anchor {at} is not supported")
        raise PatternError(f"{kind} is not supported (it needs backtracking)")

    def repeat(self, av: Any, then: int) -> int:
        low, high, sub = av
        unbounded = high == _c.MAXREPEAT
        if low > 1000 or (not unbounded and high > 1000):
            raise PatternError("a counted repeat above 1000 is not supported")
        entry = then
        if unbounded:  # a loop: split -> (body -> back to the split) | then
            loop = self.add("split", None, then)
            body = self.build(sub, loop)
            self.states[loop][1] = body
            entry = loop
        else:  # optional copies from the last: split -> (body -> the next copy) | then
            for _ in range(high - low):
                body = self.build(sub, entry)
                entry = self.add("split", body, then)
        for _ in range(low):
            entry = self.build(sub, entry)
        return entry


def compile_pattern(pattern: str) -> Callable[[str], bool]:
    """A function telling whether ``re.match(pattern, name)`` would match, in linear time;
    ``PatternError`` for a pattern it refuses."""
    if len(pattern) > MAX_PATTERN:
        raise PatternError(f"it is longer than {MAX_PATTERN} characters")
    try:
        parsed = _p.parse(pattern)
    except Exception as exc:  # re.error, RecursionError on absurd nesting
        raise PatternError(f"it is not a regular expression: {exc}") from None
    flags = parsed.state.flags & ~(_c.SRE_FLAG_UNICODE)
    if flags:
        raise PatternError("inline flags are not supported")
    nfa = _Nfa()
    done = nfa.add("match")
    try:
        start = nfa.build(parsed.data, done)
    except RecursionError:
        raise PatternError("it nests too deeply") from None
    states = nfa.states

    def matches(name: str) -> bool:
        codes = [ord(ch) for ch in name]
        end = len(codes)
        current = _closure(states, [start], 0, end)
        for i, c in enumerate(codes):
            if done in current:
                return True
            step = [s[2] for s in (states[j] for j in current) if s[0] == "char" and s[1](c)]
            if not step:
                return False
            current = _closure(states, step, i + 1, end)
        return done in current

    return matches


def _closure(states: list[list[Any]], todo: list[int], at: int, end: int) -> set[int]:
    """Every state reachable from ``todo`` without reading a character, at position ``at``."""
    seen: set[int] = set()
    result: set[int] = set()
    while todo:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        state = states[j]
        kind = state[0]
        if kind == "split":
            todo.extend((state[1], state[2]))
        elif kind in ("begin", "end"):
            if at == (0 if kind == "begin" else end):
                todo.append(state[1])
        else:
            result.add(j)
    return result
