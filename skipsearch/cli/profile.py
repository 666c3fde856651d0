"""`profile`: measure this device's cost model and save it as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..decode.cost_profile import shipped_profiles
from .arguments import add_model_flags, add_studies_dir, context_lengths, positive_int, settings_of


HELP = "measure the cost model of this device and save it as JSON"
DESCRIPTION = ("Time attention, MLP, the rest of a forward and verification of 1..9 tokens at several "
               "context lengths on this device and dtype, and what decoding pays besides forwards; "
               "`optimize --objective modeled --cost-profile`, `bench` and `--project-with` read the file. They "
               "also take the name of a profile that ships with skipsearch, measured on a GPU with random weights: "
               f"{', '.join(shipped_profiles())}.")


def cmd_profile(args: argparse.Namespace) -> int:
    from ..api.profile import ProfileSettings, profile_device  # here: it imports torch, which --help does without
    from ..costs.profiler import format_profile

    profile, output = profile_device(settings_of(ProfileSettings, args))
    print(format_profile(profile))
    print(f"wrote {output}")
    return 0


def add_profile_flags(prof: argparse.ArgumentParser) -> None:
    prof.add_argument("--output", type=Path, default=None,
                      help="profile JSON to write (default: <studies-dir>/cost-profile.json)")
    add_studies_dir(prof)
    prof.add_argument("--contexts", type=context_lengths, default=None,
                      help="context lengths (cached tokens) to time at, e.g. 128,1024,4096 (default: 128,1024 on a "
                           "CPU; on CUDA up to 32768 as the model's positions and the device's memory allow)")
    prof.add_argument("--config-only", action="store_true",
                      help="build --model from its config alone (a folder with config.json, a config .json file or "
                           "a Hub name, whose weights are not fetched) with random weights: costs do not depend "
                           "on the weights' values")
    prof.add_argument("--repeats", type=positive_int, default=20,
                      help="timed runs per measurement (median); under 5 the noise is not checked, which the profile "
                           "says")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_flags(prof).add_argument(
        "--compile", action="store_true",
        help="time the compiled steps studies run (regional) on a CPU too; on CUDA they are always timed, as CUDA graphs")
