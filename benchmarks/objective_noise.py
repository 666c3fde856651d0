"""How noisy is a trial's speed figure? Plain decoding measured against plain decoding (a benchmark script).

Every "speedup" here should be 1.0: the candidate is plain decoding itself. Its spread is the
noise a study ranks skip sets through. Two ways of measuring, on an idle and on a loaded machine:

  unpaired  (before issue 8) the baseline is timed once at the start; each trial then decodes the
            prompts and divides its tokens/s by that baseline's
  paired    (now) each trial times plain decoding and the candidate back to back per prompt, in
            alternating order, and reports the geometric mean of the ratios with a 95% interval

`--load` starts two busy processes that switch on and off at random (0.5-3 s each), as other
jobs on a shared machine do.

    python benchmarks/objective_noise.py --trials 10 --json studies/noise-idle.json
    python benchmarks/objective_noise.py --trials 10 --load --json studies/noise-loaded.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import statistics
import time

from skipsearch import load_model
from skipsearch.costs.profiler import device_name
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt
from skipsearch.search.evaluation import Evaluator


def busy_on_and_off(seed: int, stop_at: float) -> None:
    """Burn one core for a random 0.5-3 s, rest for a random 0.5-3 s, until `stop_at`."""
    rng = random.Random(seed)
    while time.time() < stop_at:
        until = time.time() + rng.uniform(0.5, 3.0)
        while time.time() < until:
            sum(i * i for i in range(10_000))
        time.sleep(rng.uniform(0.5, 3.0))


def summary(values: list[float]) -> dict[str, float]:
    logs = [math.log(v) for v in values]
    return {"n": len(values), "geomean": math.exp(statistics.fmean(logs)), "min": min(values), "max": max(values),
            "sd_of_log": statistics.stdev(logs) if len(logs) > 1 else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--load", action="store_true", help="two busy processes switching on and off at random")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    loaded = load_model(args.model)
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompts(num_prompts=args.num_prompts)]
    eos = loaded.model.generation_config.eos_token_id
    evaluator = Evaluator(model=loaded.model, prompts=prompts, max_new_tokens=args.max_new_tokens,
                          policy=DraftPolicy(), eos_token_id=eos)
    evaluator.reference_tokens()  # warm-up

    workers = []
    if args.load:
        stop_at = time.time() + 24 * 3600
        workers = [multiprocessing.Process(target=busy_on_and_off, args=(seed, stop_at), daemon=True)
                   for seed in range(2)]
        for worker in workers:
            worker.start()
    try:
        def tokens_per_second() -> float:
            start = time.perf_counter()
            tokens = sum(len(generate(loaded.model, p, max_new_tokens=args.max_new_tokens, eos_token_id=eos).tokens)
                         for p in prompts)
            return tokens / (time.perf_counter() - start)

        baseline = tokens_per_second()
        unpaired, paired, widths, covered = [], [], [], 0
        for trial in range(args.trials):
            # Interleaved trial by trial, so both methods see the same stretch of load.
            unpaired.append(tokens_per_second() / baseline)
            interval = evaluator.evaluate(SkipSet()).speedup
            paired.append(interval.estimate)
            widths.append(interval.high / interval.low)
            covered += interval.low <= 1.0 <= interval.high
            print(f"trial {trial}: unpaired {unpaired[-1]:.3f}x, paired {interval}", flush=True)
    finally:
        for worker in workers:
            worker.terminate()

    result = {
        "machine": device_name(loaded.model.device), "load": args.load, "trials": args.trials,
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "unpaired": summary(unpaired), "paired": summary(paired),
        "paired_interval_ratio_high_over_low_median": statistics.median(widths),
        "paired_intervals_containing_1": covered,
        "values": {"unpaired": unpaired, "paired": paired},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "values"}, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
