"""`python -m skipsearch <command>`: generate, optimize, export, plot, bench, profile, check-family."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# Nothing heavy at module level: `--help` must answer without importing torch, transformers or optuna. Each command
# imports the library function it calls when it runs.
from .arguments import DefaultsFormatter, Parser
from .bench import add_bench, cmd_bench
from .check_family import add_check_family, cmd_check_family
from .generate import add_generate, cmd_generate
from .optimize import add_optimize, cmd_optimize
from .process import console_that_cannot_fail, run
from .profile import add_profile, cmd_profile
from .study import add_export, add_plot, cmd_export, cmd_plot


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m skipsearch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    # The commands are looked up here, when the parser is built, so that tests can stand in for one.
    for add_command, command in ((add_generate, cmd_generate), (add_optimize, cmd_optimize), (add_bench, cmd_bench),
                                 (add_profile, cmd_profile), (add_export, cmd_export), (add_plot, cmd_plot),
                                 (add_check_family, cmd_check_family)):
        add_command(commands, DefaultsFormatter).set_defaults(run=command)
    for sub in commands.choices.values():
        # The tool's own errors start like argparse's ("python -m skipsearch plot: error: ..."): one form for both.
        sub.set_defaults(prog=sub.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with console_that_cannot_fail():
        return run(args)
