"""The same decoding from two revisions of skipsearch, interleaved in one process (a benchmark script, not a test).

An engine change is judged by what it does to speed on the same machine, in the same minutes: this loads the
package as it was at `--before` (a git revision, extracted into a temporary folder as `skipsearch_before`) beside
the working tree's, each with its own copy of the model, and decodes every prompt by every method of both back to
back in a rotating order (`bench.timed_runs`). For each method it prints both tokens/s and the paired ratio
after / before (geometric mean of the per-run ratios, 95% interval; above 1 the working tree is faster), and
whether both revisions' outputs are identical. Only the public API (`generate`, `SkipSet`, `DraftPolicy`,
`DraftMemory`, `load_model`, `load_skip_config`) of the older revision is called. Methods: plain decoding and each
skip set at a fixed draft length, and with `--config` an exported config's set (its trimmed head included) under its
own draft policy; the guard off, one `DraftMemory` per method across its calls (as `bench` keeps), eager steps (and
compiled ones with `--compile`).

    python benchmarks/before_after.py --before 5f12c3b --skip-sets "a20;a16,20,24;a20|m18"
    python benchmarks/before_after.py --before 4037b00 --model gemma-3-270m --skip-sets "" --config studies/gemma/best.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch

import skipsearch
from skipsearch import SkipSet
from skipsearch.report.bench import Decoder, timed_runs
from skipsearch.io.data import load_prompts
from skipsearch.search.measure import ratio_interval
from skipsearch.io.models import encode_prompt

from decode_speed import parse_skip_sets

ROOT = Path(__file__).resolve().parent.parent


def package_at(revision: str, folder: Path):
    """skipsearch as it was at `revision`, imported under the name `skipsearch_before`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, "skipsearch"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "skipsearch").rename(folder / "skipsearch_before")
    sys.path.insert(0, str(folder))
    return importlib.import_module("skipsearch_before")


def decoders_of(package, label: str, skip_sets: list[SkipSet], args: argparse.Namespace):
    """Plain decoding and each skip set through one revision's public `generate`, and the tokenizer it loaded."""
    loaded = package.load_model(args.model, dtype=args.dtype, device=args.device)
    model, eos = loaded.model, loaded.model.generation_config.eos_token_id
    policy = package.DraftPolicy(max_draft_tokens=args.max_draft_tokens, adaptive=False, guard=False)
    # That revision's own SkipSet: a package's checks may refuse another's type.
    methods = {"plain": (None, policy)} | {
        spec: (package.SkipSet.of(skip.attn, skip.mlp, model.config.num_hidden_layers), policy)
        for spec, skip in zip(args.skip_sets.split(";"), skip_sets)}
    if args.config:
        config = package.load_skip_config(args.config, model, loaded.tokenizer)
        methods["config"] = (config.skip, dataclasses.replace(config.draft, guard=False))
    decoders: dict[str, Decoder] = {}
    for compile in [False, True] if args.compile else [False]:
        for name, (skip, method_policy) in methods.items():
            def decode(prompt, skip=skip, policy=method_policy, compile=compile, memory=package.DraftMemory()):
                out = package.generate(model, prompt, skip=skip, max_new_tokens=args.max_new_tokens, policy=policy,
                                       eos_token_id=eos, compile=compile, memory=memory)
                return out.tokens, out.stats
            decoders[f"{name} {'compiled' if compile else 'eager'} [{label}]"] = decode
    return decoders, loaded.tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--skip-sets", default="a20;a16,20,24;a20|m18", help="';'-separated (default: %(default)s)")
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-offset", type=int, default=8, help="held out from the default study's prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compiled steps too")
    parser.add_argument("--config", default=None, help="also an exported skip config's set, under its draft policy")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        before = package_at(args.before, Path(folder))
        skip_sets = parse_skip_sets(args.skip_sets, num_layers=None)
        old, _ = decoders_of(before, "before", skip_sets, args)
        new, tokenizer = decoders_of(skipsearch, "after", skip_sets, args)
        decoders = old | new
        texts = load_prompts(num_prompts=args.prompt_offset + args.num_prompts, seed=0)[args.prompt_offset:]
        prompts = [encode_prompt(tokenizer, text) for text in texts]
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"before {args.before}, after the working tree; {len(prompts)} prompts x {args.max_new_tokens} new "
              f"tokens, {args.repeats} repeats, torch threads {torch.get_num_threads()}, k={args.max_draft_tokens}")
        runs = timed_runs(decoders, prompts, args.repeats, device, show_progress=True)
    print(f"{'method':36} {'before tok/s':>12} {'after tok/s':>11} {'after / before (95% interval)':>30} {'identical':>9}")
    for name in [n[:-len(" [before]")] for n in decoders if n.endswith("[before]")]:
        old, new = runs[f"{name} [before]"], runs[f"{name} [after]"]
        ratio = ratio_interval(new.ratios_over(old))
        same = sum(a == b for a, b in zip(old.outputs, new.outputs)) / len(old.outputs)
        print(f"{name:36} {sum(old.tokens) / sum(old.seconds):12.1f} {sum(new.tokens) / sum(new.seconds):11.1f} "
              f"{f'{ratio.estimate:.3f}x ({ratio.low:.3f}-{ratio.high:.3f})':>30} {same:9.2f}")


if __name__ == "__main__":
    main()
