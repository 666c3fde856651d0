"""`generate`: decode one prompt with self-speculative decoding."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import (add_compile_flag, add_draft_flags, add_model_flags, layer_ids, nucleus_mass, positive_int,
                        seed_value, settings_of, temperature_value, utf8_text, warn_of_deprecated_flags)

if TYPE_CHECKING:
    from ..api.generate import Generation


HELP = "decode one prompt with self-speculative decoding"
DESCRIPTION = ("Decode one prompt with self-speculative decoding (greedy output equals plain greedy decoding). "
               "The skip set comes from --config or --skip-attn/--skip-mlp; with neither, nothing is skipped and "
               "the prompt is decoded plainly. With several skip sets, the one whose drafts agree best with the "
               "full model over the prompt's last tokens is chosen, or plain decoding when none pays.")


def cmd_generate(args: argparse.Namespace) -> int:
    from ..api.generate import GenerateSettings, generate_text  # here: it imports torch, which --help does without

    warn_of_deprecated_flags(args)
    generation = generate_text(settings_of(GenerateSettings, args))
    _print_generation(args, generation)
    return 0


def _print_generation(args: argparse.Namespace, generation: Generation) -> None:
    """The text (on stdout) and what decoding it took (on stderr), or both as one JSON line with --json."""
    text, output, skip = generation.text, generation.output, generation.skip
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": output.tokens,
            "skip": skip.as_dict() if skip is not None else None,
            "stats": output.stats.as_dict(),
        }))
    else:
        print(text)
        s = output.stats
        rounds = f"{s.rounds} rounds, " if s.drafted else ""  # plain decoding's steps are no rounds of drafts
        print(
            f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {rounds}"
            f"acceptance {'-' if s.acceptance_rate is None else format(s.acceptance_rate, '.2f')} "
            f"({s.accepted}/{s.drafted}), skip {skip if skip is not None and skip.drafts else 'none (plain decoding)'}"
            + generation.choice + (f", compile {s.compile_time_s:.1f} s]" if args.compile else "]"),
            file=sys.stderr,
        )
        if s.guard.reason() is not None:
            print(f"[{s.guard.reason()}; --no-guard drafts regardless]", file=sys.stderr)


def add_generate_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--prompt", required=True, type=utf8_text, help="the user message")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--config", action="append", metavar="FILE",
                     help="skip config JSON exported by `optimize` / `export`; repeatable: with several skip sets "
                          "(several files, or a file that carries several), the prefill chooses one of them or plain "
                          "decoding for the prompt")
    gen.add_argument("--cost-profile", type=Path, default=None,
                     help="with several skip sets: price each set's drafts with this profile (a file from `profile` "
                          "or a shipped profile's name) when choosing (default: the share of the weights each draft "
                          "reads)")
    gen.add_argument("--skip-attn", type=layer_ids, default=None, help="attention layers to skip, e.g. 3,7")
    gen.add_argument("--skip-mlp", type=layer_ids, default=None, help="MLP layers to skip, e.g. 12")
    gen.add_argument("--autoregressive", action="store_true", help="decode plainly through the same loop")
    gen.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most")
    gen.add_argument("--do-sample", action="store_true", help="sample (speculative rejection sampling) instead of greedy")
    gen.add_argument("--temperature", type=temperature_value, default=None,
                     help="sampling temperature, with --do-sample (default: 1.0)")
    gen.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=nucleus_mass, default=None, help="nucleus sampling mass")
    gen.add_argument("--seed", type=seed_value, default=None,
                     help="sampling seed, with --do-sample (default: 0): the same seed gives the same text every run "
                          "(its rounds are then planned without the clock, so the guard never falls back to plain "
                          "decoding)")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics as JSON")
    gen.add_argument("--memory", type=Path, default=None, metavar="FILE",
                     help="what the guard learned in earlier runs (plain speed, when each skip set drafts again), "
                          "kept in FILE: read where it exists, written after; without it each run learns afresh")
    add_draft_flags(gen)
    add_compile_flag(add_model_flags(gen))
