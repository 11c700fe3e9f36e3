"""Every option and command of the command line says what it is for (`fp4select CMD --help`)."""

from __future__ import annotations

import argparse

import pytest

from fp4select.cli import build_parser, main


def _without_help(parser: argparse.ArgumentParser, where: str = "fp4select") -> list[str]:
    """Every option, positional and subcommand under ``parser`` that has no help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not (described.get(name) or "").strip():
                    missing.append(f"{where} {name}")
                missing += _without_help(sub, f"{where} {name}")
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            label = "/".join(action.option_strings) or action.dest
            missing.append(f"{where} {label}")
    return missing


def test_every_option_and_command_has_help_text():
    assert _without_help(build_parser()) == []


def test_the_walk_finds_an_option_or_a_command_without_help():
    """The check above must be able to fail: a parser with gaps is caught at every level."""
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--top")
    sub = parser.add_subparsers()
    quiet = sub.add_parser("quiet")  # no help=
    quiet.add_argument("path")
    sub.add_parser("loud", help="says so").add_argument("--flag", action="store_true", help="")
    assert sorted(_without_help(parser, "x")) == [
        "x --top",
        "x loud --flag",
        "x quiet",
        "x quiet path",
    ]


def test_the_top_level_help_lists_every_command_with_verify(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    description = out.split("positional arguments")[0]
    assert "verify" in description  # the one-line summary names it, not only the list
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    for command in ("doctor", "warm", "show", "explain", "blacklist", "export", "import"):
        assert command in listed
    assert "verify" in listed and "clear" in listed
