"""What the commands' flags accept and the flags several commands share; a parser that reports errors in one line."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# Nothing heavy: `--help` must answer without importing torch, transformers or optuna.
from ..constants import DEFAULT_MODEL, DTYPE_NAMES, MIN_TEMPERATURE, NAMED_MODEL_NAMES
from ..decode.policy import DEPRECATED_FIELDS, DraftPolicy, deprecation
from ..io.data import BUILTIN

Settings = TypeVar("Settings")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help once: not when the help already states its default, and not for
    flags whose default is None or False (their help says what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        silent = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not silent and "(default" not in text and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids such as 3,7,12, got {text!r}") from None


def number(kind: type, is_valid: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: `kind(text)` that satisfies `is_valid`, else a one-line error saying what was expected."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not is_valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


SEED_LIMIT = 2**32  # numpy's seeds, which Optuna's samplers use


seed_value = number(int, lambda v: 0 <= v < SEED_LIMIT, f"an integer in [0, {SEED_LIMIT - 1}]")


positive_int = number(int, lambda v: v >= 1, "an integer >= 1")


def head_sizes(text: str) -> tuple[int, ...] | None:
    """--head-rows: "auto" (None: the study's default sizes), "none" (the full head only), or sizes such as 8192,16384."""
    if text.strip() == "auto":
        return None
    if text.strip() in ("none", "0"):
        return ()
    try:
        rows = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rows = []
    if not rows or any(r < 1 for r in rows) or len(set(rows)) != len(rows):
        raise argparse.ArgumentTypeError(f"expected auto, none, or distinct sizes >= 1 such as 8192,16384, got {text!r}")
    return tuple(sorted(rows))


def context_lengths(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated context lengths such as 128,1024, got {text!r}")
    return values


non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0")


unit_float = number(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
nucleus_mass = number(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")  # --top-p: 0 would keep no token
open_unit_float = number(float, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")


positive_float = number(float, lambda v: 0 < v < math.inf, "a finite number > 0")


temperature_value = number(float, lambda v: MIN_TEMPERATURE <= v < math.inf,
                       f"a finite number >= {MIN_TEMPERATURE:g} (lower samples as greedy decoding does: leave out "
                       "--do-sample)")


def utf8_text(text: str) -> str:
    """An argparse type for free text: it must be UTF-8 (undecodable bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (byte {error.start} of {text[:20]!r})") from None
    return text


def add_model_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model's flags, in a group that a command's --compile joins."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=None,
        help=f"a named model ({', '.join(NAMED_MODEL_NAMES)}), a Hugging Face name, a local folder or "
             f"a .gguf file (default: the embedded {DEFAULT_MODEL})",
    )
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    group.add_argument(
        "--dtype", default=None, choices=DTYPE_NAMES, help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)"
    )
    return group


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("drafting (defaults: the config's values, else the ones shown)")
    d = DraftPolicy()
    group.add_argument("--max-draft-tokens", type=non_negative_int, default=None,
                       help=f"most tokens drafted per round (default: {d.max_draft_tokens})")
    group.add_argument("--fixed-draft", action="store_true",
                       help="always draft --max-draft-tokens tokens (default: each round's length planned by the draft "
                            "controller from the acceptance seen and the price of a round)")
    for flag in ("--confidence-threshold", "--target-acceptance", "--threshold-step", "--stop-rule"):
        group.add_argument(flag, default=None, help=argparse.SUPPRESS)  # deprecated: the old rules' (issue 27)
    group.add_argument("--no-guard", action="store_true",
                       help="draft even when drafting measures slower than plain decoding (default: the controller's "
                            "guard decodes plainly then, and probes drafting again later)")


def warn_of_deprecated_flags(args: argparse.Namespace) -> None:
    """One warning line for the old rules' flags (issue 27), which are accepted and ignored."""
    old = [f"--{name.replace('_', '-')}" for name in DEPRECATED_FIELDS if getattr(args, name, None) is not None]
    if old:
        print(f"warning: {deprecation(old, 'the flags')}", file=sys.stderr)


def settings_of(kind: type[Settings], args: argparse.Namespace) -> Settings:
    """The library's settings for a command, each field taken from the flag of the same name."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind)})


def study_name_text(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", text):
        raise argparse.ArgumentTypeError(
            f"study names are 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit; got {text!r}"
        )
    return text


def add_studies_dir(group: argparse._ActionsContainer) -> None:
    group.add_argument("--studies-dir", type=Path, default=Path("studies"),
                       help="where studies, exported configs, plots, benchmarks and cost profiles live")


def add_study_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("study")
    group.add_argument("--study-name", type=study_name_text, default="default", help="name of the Optuna study")
    add_studies_dir(group)
    group.add_argument("--storage", default=None,
                       help="an Optuna storage: a SQLAlchemy URL such as postgresql+psycopg2://user:pw@host/db "
                            "(many machines) or journal:<file> (many processes, one machine) "
                            "(default: sqlite:///<studies-dir>/<study-name>.db)")


class _OneDataset(argparse.Action):
    """--dataset of a command that reads one: a second, which `optimize` would read too, is refused rather than taken
    in place of the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = f"_{self.dest}_given"  # not the value: a first --dataset equal to the default is given all the same
        if getattr(namespace, given, False):
            parser.error(f"argument {option_string}: given twice; this command reads one dataset (a study reads "
                         "several: `optimize --dataset A --dataset B`)")
        setattr(namespace, given, True)
        setattr(namespace, self.dest, values)


def add_prompt_flags(parser: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int,
                      several_datasets: bool = False) -> argparse._ArgumentGroup:
    data = parser.add_argument_group("prompts")
    kinds = ("'builtin' (32 prompts shipped), a local .json/.jsonl file, or a Hub dataset name (NAME:CONFIG for one "
             "of its configs)")
    if several_datasets:
        data.add_argument("--dataset", action="append", default=None,
                          help=f"{kinds}; repeatable: --num-prompts of each are decoded, and sets are ranked per "
                               f"dataset too, so best.json carries each dataset's best set (default: {BUILTIN})")
    else:
        data.add_argument("--dataset", default=BUILTIN, action=_OneDataset, help=kinds)
    data.add_argument("--field", default="prompt",
                      help="the dataset field holding the prompt: text, or a list of user turns (a conversation: "
                           "each later turn is asked after the model's own answer to the one before)")
    data.add_argument("--split", default="train", help="the split of a Hub dataset")
    data.add_argument("--num-prompts", type=positive_int, default=num_prompts, help="prompts to decode")
    data.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, help="tokens decoded per prompt")
    data.add_argument("--raw", action="store_true", help="tokenize prompts as is, without the chat template")
    data.add_argument("--category-field", default=None, metavar="NAME",
                      help="the field naming each prompt's category, which every row must then have; the draw takes "
                           "prompts of every category in turn; 'none': no categories (default: 'category' where the "
                           "rows have it, left out with a note where a row has none or there are more categories "
                           "than --num-prompts)")
    data.add_argument("--too-long", choices=("refuse", "skip"), default="refuse",
                      help="a prompt whose answers do not fit the model's context (checked before any decoding): "
                           "refuse the run, or skip that prompt with a line saying so")
    return data


def add_compile_flag(group: argparse._ActionsContainer,
                      on_cpu: str = "frozen weights and autotuned GEMMs on a CPU, about 100 s per step to compile",
                      when: str = "the first call compiles") -> None:
    group.add_argument("--compile", action="store_true",
                       help=f"torch.compile the draft and verify steps (CUDA graphs on CUDA; {on_cpu}); {when}")


def add_projection_flag(group: argparse._ActionsContainer, whose: str, stored: str = "") -> None:
    group.add_argument("--project-with", type=Path, action="append", metavar="PROFILE",
                       help=f"also print {whose} speedup PREDICTED with this cost profile, e.g. a GPU's: a file "
                            f"or a shipped profile's name such as nvidia-h200/llama-3-8b (repeatable; a prediction, "
                            f"not a measurement{stored})")


def add_number_flags(group: argparse._ActionsContainer,
                     flags: list[tuple[str, Callable[[str], float], float | None, str]]) -> None:
    """Flags that take one number each: (the flag, its type, its default, its help)."""
    for flag, kind, default, text in flags:
        group.add_argument(flag, type=kind, default=default, help=text)
