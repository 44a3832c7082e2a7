"""The ``vlfuse`` command: a light dispatcher to its subcommands.

``fit``, ``validate`` and ``test`` are Lightning's CLI (:mod:`vlfuse.commands.lightning`); ``predict``,
``caption``, ``analyze`` and ``prune`` are vlfuse's own tools (:mod:`vlfuse.commands`). A subcommand's
module is imported only when it runs, so ``vlfuse --help``, a mistyped subcommand and
``import vlfuse.cli`` load neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import textwrap

import vlfuse
from vlfuse.commands import LIGHTNING, SUBCOMMANDS
from vlfuse.errors import error_line, one_line
from vlfuse.runtime import prefer_passive_waits


USER_ERRORS = (ValueError, FileNotFoundError, KeyError, argparse.ArgumentError)
FIRST_STEP = "vlfuse fit --config configs/easy_vqa.yaml"


def help_text() -> str:
    """``vlfuse --help``: every subcommand with its whole description."""
    width = max(map(len, SUBCOMMANDS))
    indent = " " * (width + 4)
    described = [
        textwrap.fill(sub.description, 100, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent)
        for name, sub in SUBCOMMANDS.items()
    ]
    lines = [
        f"usage: vlfuse {{{','.join(SUBCOMMANDS)}}} [options]",
        "",
        "Vision-language fusion with analysable multi-head cross-attention: train, evaluate, answer",
        "questions about images, and study and prune the attention heads.",
        "",
        "subcommands:",
        *described,
        "",
        "'vlfuse SUBCOMMAND --help' lists a subcommand's options. Start with:",
        f"  {FIRST_STEP}",
        "Set VLFUSE_DEBUG=1 to see the traceback behind an error.",
    ]
    return "\n".join(lines)


def unknown_subcommand(name: str) -> str:
    """The one line for a subcommand that does not exist, with the closest one."""
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    guess = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown subcommand '{name}'{guess}; the subcommands are {', '.join(SUBCOMMANDS)} (vlfuse --help)"


def run_subcommand(args: list[str], argv: list[str] | None) -> int:
    """Import the subcommand's module and run it; ``argv`` is None when the arguments come from ``sys.argv``."""
    subcommand = SUBCOMMANDS[args[0]]
    module = importlib.import_module(subcommand.module)
    if args[0] in LIGHTNING:
        return module.main(argv)  # LightningCLI reads sys.argv itself when argv is None
    return module.main(args[1:]) or 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vlfuse`` command (``argv`` default ``sys.argv[1:]``); returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(help_text(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"vlfuse {vlfuse.__version__}")
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"vlfuse: error: {unknown_subcommand(args[0])}", file=sys.stderr)
        return 2
    prefer_passive_waits()  # before a subcommand imports torch, which reads it
    try:
        return run_subcommand(args, argv)
    except Exception as err:
        line = error_line(err, args[0])
        if line is None and isinstance(err, USER_ERRORS):
            line = one_line(err, args[0], args)
        if line is None or os.environ.get("VLFUSE_DEBUG"):
            raise
        print(f"vlfuse: error: {line}", file=sys.stderr)
        return 2


def run_lightning(args: list[str] | None = None):
    """:func:`vlfuse.commands.lightning.run_lightning`, imported when called: the CLI object of a Lightning run."""
    from vlfuse.commands.lightning import run_lightning as run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
