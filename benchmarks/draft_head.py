"""The trimmed draft head: what the LM head costs, what a trimmed one saves, and what a ranking covers (a benchmark).

Three measurements on one model, each named with its machine by the caller:
1. coverage: the plain greedy tokens of held-out built-in prompts (not among the calibration prompts that made the
   ranking) that a head of N rows holds, for the study's ranking (`search/vocabulary.py`: the model's summed
   probabilities over the calibration prompts and their continuations, special tokens first) and, for comparison,
   rankings by the count of greedy tokens and by lowest id;
2. the head's matmul alone, full and trimmed, paired and interleaved;
3. one-token forwards in the engine's steps, eager (what a study runs on a CPU by default) and regional compiled
   (`optimize --compile`, and CUDA's default): the plain step (full model), and the draft step of an empty skip set
   with the head trimmed to each size, paired and interleaved.

    python benchmarks/draft_head.py --model gemma-3-270m --rows 4096,8192,16384,32768 --repeats 30
    python benchmarks/draft_head.py --config-only benchmarks/configs/gemma-3-270m.json --device cuda --dtype bfloat16

With --config-only (random weights: the GPU machine has no model files) only the timings run, with the lowest ids as
the head's rows: timing does not depend on which rows, only on how many.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.loop import generate
from skipsearch.decode.skipset import SkipSet
from skipsearch.decode.steps import synchronize
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, load_model, model_from_config
from skipsearch.search.measure import ratio_interval
from skipsearch.search.vocabulary import VocabularyRanking, rank_vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--rows", default="4096,8192,16384,32768", help="head sizes (default: %(default)s)")
    parser.add_argument("--calibration", type=int, default=8, help="prompts that make the ranking (default: 8)")
    parser.add_argument("--held-out", type=int, default=8, help="prompts it is judged on (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    parser.add_argument("--repeats", type=int, default=30, help="paired timings of each kind (default: 30)")
    parser.add_argument("--skip-timing", action="store_true", help="coverage only")
    parser.add_argument("--config-only", default=None, help="a config to build with random weights: timings only")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: bfloat16 on CUDA, else float32)")
    parser.add_argument("--modes", default="eager,regional", help="step modes timed (default: %(default)s)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    if args.config_only:
        model = model_from_config(args.config_only, device=args.device, dtype=args.dtype).eval()
        print(f"{args.config_only} (random weights) on {model.device}, {model.dtype}: timings only")
        ranking = VocabularyRanking(tuple(range(model.get_output_embeddings().weight.shape[0])))
        timings(model, list(range(1, 33)), ranking, rows, args.repeats, modes)
        return
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    texts = load_prompts(num_prompts=args.calibration + args.held_out, seed=0)
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    eos = model.generation_config.eos_token_id
    greedy = [generate(model, p, max_new_tokens=args.max_new_tokens, eos_token_id=eos).tokens for p in prompts]
    calibration, held_out = slice(0, args.calibration), slice(args.calibration, None)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    print(f"{loaded.name_or_path}: vocabulary {vocab_size}, hidden {model.config.hidden_size}; ranking from "
          f"{args.calibration} prompts, judged on {args.held_out} others, {args.max_new_tokens} greedy tokens each")
    coverage(model, tokenizer, prompts[calibration], greedy[calibration], greedy[held_out], rows, vocab_size)
    if not args.skip_timing:
        timings(model, prompts[0], rank_vocabulary(model, prompts[calibration], greedy[calibration],
                                                   tokenizer.all_special_ids), rows, args.repeats, modes)


def timings(model, prompt, ranking, rows, repeats, modes) -> None:
    print(f"device: {model.device}, {str(model.dtype).removeprefix('torch.')}")
    head_matmul(model, ranking, rows, repeats)
    for mode in modes:
        one_token_steps(model, prompt, ranking, rows, repeats, mode)


def coverage(model, tokenizer, prompts, continuations, held_out, rows, vocab_size) -> None:
    counts = collections.Counter(t for tokens in continuations for t in tokens)
    rankings = {
        "summed probabilities (the study's)": rank_vocabulary(model, prompts, continuations, tokenizer.all_special_ids),
        "greedy token counts": VocabularyRanking(tuple(sorted(range(vocab_size), key=lambda t: (-counts[t], t)))),
        "lowest ids": VocabularyRanking(tuple(range(vocab_size))),
    }
    tokens = [t for tokens in held_out for t in tokens]
    print(f"\ncoverage of {len(tokens)} held-out greedy tokens by a head of N rows")
    print(f"{'ranking':36}" + "".join(f"{r:>9}" for r in rows))
    for name, ranking in rankings.items():
        print(f"{name:36}" + "".join(f"{ranking.coverage(tokens, r):9.3f}" for r in rows))


def _paired(baseline, candidates: dict, repeats: int, device: torch.device) -> dict:
    """Per candidate: baseline time over its time, paired and interleaved (order alternating), with intervals."""
    ratios = {name: [] for name in candidates}
    seconds = {name: [] for name in ("baseline", *candidates)}
    for i in range(repeats):
        for name, run in candidates.items():
            pair = [("baseline", baseline), (name, run)][:: 1 if i % 2 else -1]
            times = {}
            for label, fn in pair:
                synchronize(device)
                start = time.perf_counter()
                fn()
                synchronize(device)
                times[label] = time.perf_counter() - start
            ratios[name].append(times["baseline"] / times[name])
            seconds["baseline"].append(times["baseline"])
            seconds[name].append(times[name])
    return {name: (ratio_interval(r), sorted(seconds[name])[len(seconds[name]) // 2]) for name, r in ratios.items()} | {
        "baseline": (None, sorted(seconds["baseline"])[len(seconds["baseline"]) // 2])}


@torch.inference_mode()
def head_matmul(model, ranking, rows, repeats) -> None:
    weight = model.get_output_embeddings().weight
    hidden = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    trimmed = {r: weight[torch.tensor(ranking.ids[:r], device=weight.device)].contiguous() for r in rows}
    runs = _paired(lambda: hidden @ weight.T, {r: (lambda m=m: hidden @ m.T) for r, m in trimmed.items()}, repeats,
                   weight.device)
    print(f"\nthe head's matmul, one token: full {runs['baseline'][1] * 1e3:.2f} ms (median)")
    for r in rows:
        interval, median = runs[r]
        print(f"  {r:>6} rows: {median * 1e3:.2f} ms, full over trimmed {interval.estimate:.2f}x "
              f"({interval.low:.2f}-{interval.high:.2f})")


@torch.inference_mode()
def one_token_steps(model, prompt, ranking, rows, repeats, mode) -> None:
    """The engine's steps (eager, or compiled in `mode`): the plain step against draft steps trimmed to each size."""
    settings, engine = None if mode == "eager" else CompileSettings(mode=mode), engine_for(model)
    length = len(prompt) + 64
    skips = {r: SkipSet(head=ranking.head(r)) for r in rows}
    plain = engine.prepare(length, None, settings, 1)
    cache = plain.cache  # eager steps get a fresh cache: every step below writes this one
    drafts = {r: engine.steps_for(cache, skip, settings, 1).draft for r, skip in skips.items()}
    cache.seek(0)
    plain.prefill(torch.tensor([prompt], device=model.device))
    one = torch.tensor([[prompt[-1]]], device=model.device)
    position = int(cache.position)

    def step(run):
        def call():
            cache.seek(position)
            run(one)
        return call

    for run in (plain.plain, *drafts.values()):  # compile and warm every step before timing
        for _ in range(3):
            step(run)()
    runs = _paired(step(plain.plain), {r: step(d) for r, d in drafts.items()}, repeats, model.device)
    full = runs["baseline"][1]
    weight = model.get_output_embeddings().weight
    head = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    head_s = min(_timed(lambda: head @ weight.T, model.device) for _ in range(repeats))
    print(f"\none-token forwards, {mode} steps: plain step {full * 1e3:.2f} ms (median); the head's "
          f"matmul alone (fastest of {repeats}) {head_s * 1e3:.2f} ms, {head_s / full:.0%} of it")
    for r in rows:
        interval, median = runs[r]
        print(f"  draft step, nothing skipped, head of {r:>6} rows: {median * 1e3:.2f} ms; plain over draft "
              f"{interval.estimate:.2f}x ({interval.low:.2f}-{interval.high:.2f})")


def _timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
