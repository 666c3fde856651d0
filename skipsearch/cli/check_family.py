"""`check-family`: check that skipsearch runs a model family right, on a tiny model of its config."""

from __future__ import annotations

import argparse

from .arguments import seed_value


HELP = "check that skipsearch runs a model family right, on a tiny model of its config"
DESCRIPTION = ("Build a tiny random-weight model of --model's config (4 layers, hidden size 32; no weights are "
               "fetched) and check the draft path against the definition of a skip: its logits equal the "
               "model's with the skipped sublayers' outputs zeroed by forward hooks, and with every sublayer "
               "zeroed the layers pass the residual stream through; then greedy self-speculative decoding, eager "
               "and compiled, equals transformers' greedy output. Exit 0 when every check passes, 1 when one "
               "fails, 2 for a family the tool cannot run (with why).")


def cmd_check_family(args: argparse.Namespace) -> int:
    from ..decode.families import check_family, format_check  # here: it imports torch, which --help does without

    check = check_family(args.model, seed=args.seed, compile=not args.no_compile)
    print(format_check(check))
    return 0 if not check.problems else 1


def add_check_family_flags(check: argparse.ArgumentParser) -> None:
    check.add_argument("--model", required=True,
                       help="the config: a folder with config.json, a config .json file or a Hub name")
    check.add_argument("--seed", type=seed_value, default=0, help="seed of the random weights")
    check.add_argument("--no-compile", action="store_true", help="leave out the compiled decoding (dynamo, ~1 min)")
