"""A shorter ``vlfuse fit | validate | test --help``.

Lightning's CLI prints a usage block that lists every option again (about 110 lines) and a paragraph for
each of the Trainer's ~45 options, which Lightning documents on its own site. Here the usage is one line and
each ``--trainer.*`` option is one line with its default, so that vlfuse's own options (model, data,
checkpoint, export, progress) are what the help is about.
"""

from __future__ import annotations

from argparse import SUPPRESS, Action

from jsonargparse import DefaultHelpFormatter

TRAINER_DOCS = "https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-flags"
USAGE = "%(prog)s [-h] [-c CONFIG] [--print_config] [--OPTION VALUE ...]"
"""One usage line for Lightning's subcommands (argparse fills in ``%(prog)s``)."""
LIGHTNING_TRAINER_HEADING = "Customize every aspect of training via flags"
TRAINER_HEADING = f"Lightning's Trainer (each option is described at {TRAINER_DOCS})"


class ShortTrainerHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter, with one line for each ``--trainer.*`` option: its flag and its default."""

    def start_section(self, heading: str | None) -> None:
        super().start_section(TRAINER_HEADING if heading == LIGHTNING_TRAINER_HEADING else heading)

    def _format_action(self, action: Action) -> str:
        if not action.dest.startswith("trainer.") or action.help == SUPPRESS:
            return super()._format_action(action)
        default = "" if action.default in (None, SUPPRESS) else f"  (default: {action.default})"
        return f"{' ' * self._current_indent}{self._format_action_invocation(action)}{default}\n"
