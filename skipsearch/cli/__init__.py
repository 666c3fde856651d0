"""`python -m skipsearch <command>`: generate, optimize, export, plot, bench, profile, check-family."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# Nothing heavy at module level: `--help` must answer without importing torch, transformers or optuna. Each command
# imports the library function it calls when it runs.
from . import bench, check_family, generate, optimize, profile, study
from .arguments import DefaultsFormatter, Parser
from .bench import cmd_bench
from .check_family import cmd_check_family
from .generate import cmd_generate
from .optimize import cmd_optimize
from .process import console_that_cannot_fail, run
from .profile import cmd_profile
from .study import cmd_export, cmd_plot


class _Commands(Parser):
    """The top parser, whose error for an unknown flag names the command, as every other error does (argparse's own
    names none: a command's parser leaves unknown flags to the top one)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:
        known, unknown = self.parse_known_args(args, namespace)
        if unknown:  # `prog`: the command's, which each command's parser sets as a default
            self.exit(2, f"{known.prog}: error: unrecognized arguments: {' '.join(unknown)}\n")
        return known


def build_parser() -> argparse.ArgumentParser:
    parser = _Commands(prog="python -m skipsearch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    # The commands are looked up here, when the parser is built, so that tests can stand in for one.
    for name, help_text, description, add_flags, command in (
        ("generate", generate.HELP, generate.DESCRIPTION, generate.add_generate_flags, cmd_generate),
        ("optimize", optimize.HELP, optimize.DESCRIPTION, optimize.add_optimize_flags, cmd_optimize),
        ("bench", bench.HELP, bench.DESCRIPTION, bench.add_bench_flags, cmd_bench),
        ("profile", profile.HELP, profile.DESCRIPTION, profile.add_profile_flags, cmd_profile),
        ("export", study.EXPORT_HELP, study.EXPORT_DESCRIPTION, study.add_export_flags, cmd_export),
        ("plot", study.PLOT_HELP, study.PLOT_DESCRIPTION, study.add_plot_flags, cmd_plot),
        ("check-family", check_family.HELP, check_family.DESCRIPTION, check_family.add_check_family_flags,
         cmd_check_family),
    ):
        sub = commands.add_parser(name, help=help_text, description=description, formatter_class=DefaultsFormatter)
        add_flags(sub)
        # The tool's own errors start like argparse's ("python -m skipsearch plot: error: ..."): one form for both.
        sub.set_defaults(run=command, prog=sub.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with console_that_cannot_fail():
        return run(args)
