"""Search efficiency at a fixed trial budget, on one model (a benchmark script, not a test).

Strategies, all on the same objective (speed x acceptance, wall clock), prompts and budget:
  default      TPE (multivariate), sparse prior (skip_prior 0.15), pre-screen + median pruning, warm starts
  gp           Optuna's GP sampler, sparse prior, pre-screen + pruning, warm starts
  random       random search, sparse prior, nothing else
  random-2L    random search over plain 2L switches (skip_prior 0.5), as in Draft & Verify's space

Reports the best score after 5, 10, ... trials, counting all trials and counting only trials
that skip something (the plain-decoding trial scores about 1 and hides the rest), the best
speedup among skipping trials, and wall time.

    python benchmarks/search_efficiency.py --n-trials 20 --json studies/search_efficiency.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from optuna.trial import TrialState

from skipsearch import load_model
from skipsearch.decode.config import ModelInfo
from skipsearch.decode.policy import DraftPolicy
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt
from skipsearch.search.study import SearchSpace, StudySettings, distinct_trials, run_study

STRATEGIES = {
    "default": dict(sampler="tpe", skip_prior=0.15, min_match=0.5, warm_starts=True, pruning=True),
    "gp": dict(sampler="gp", skip_prior=0.15, min_match=0.5, warm_starts=True, pruning=True),
    "random": dict(sampler="random", skip_prior=0.15, min_match=0.0, warm_starts=False, pruning=False),
    "random-2L": dict(sampler="random", skip_prior=0.5, min_match=0.0, warm_starts=False, pruning=False),
}


def best_so_far(trials, counts, skipping_only):
    out = []
    for count in counts:
        scores = [t.values[0] for t in trials[:count] if t.state == TrialState.COMPLETE
                  and (not skipping_only or (t.skipped or 0) > 0)]
        out.append(max(scores) if scores else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    loaded = load_model(args.model)
    model = loaded.model
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompts(num_prompts=args.num_prompts, seed=args.seed)]
    counts = sorted({*range(5, args.n_trials + 1, 5), args.n_trials})
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.strategies.split(","):
            options = dict(STRATEGIES[name])
            space = SearchSpace(num_layers=model.config.num_hidden_layers, skip_prior=options.pop("skip_prior"))
            settings = StudySettings(
                study_name=name, storage=f"sqlite:///{folder}/{name}.db", n_trials=args.n_trials, seed=args.seed,
                num_prompts=len(prompts), max_new_tokens=args.max_new_tokens, show_progress_bar=False, **options,
            )
            start = time.perf_counter()
            study = run_study(model, ModelInfo.of(model, loaded.name_or_path), loaded.dtype_name, prompts, settings,
                              space, DraftPolicy(), model.generation_config.eos_token_id)
            seconds = time.perf_counter() - start
            trials = distinct_trials(study)  # repeated proposals are answered without decoding: not counted
            skipping = [t for t in trials if t.figures and t.figures.speedup is not None and t.skipped]
            fastest = max(skipping, key=lambda t: t.figures.speedup.estimate, default=None)
            results[name] = {
                "best_score": best_so_far(trials, counts, skipping_only=False),
                "best_skipping_score": best_so_far(trials, counts, skipping_only=True),
                "best_skipping_speedup": fastest.figures.speedup.estimate if fastest else None,
                "best_skipping_set": [list(fastest.skip.attn), list(fastest.skip.mlp)] if fastest else None,
                "decoded to the end": sum(t.stopped_early is None and t.screened_out is None for t in trials),
                "stopped early or screened out": sum(t.stopped_early is not None or t.screened_out is not None
                                                     for t in trials),
                "mean_skipped": sum(t.skipped or 0 for t in trials) / len(trials),
                "wall_s": seconds,
            }
            print(name, json.dumps(results[name]), flush=True)

    print(f"\nbest score after {counts} trials (all trials | skipping trials only), "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {loaded.name_or_path} on {model.device}")
    for name, r in results.items():
        both = " ".join(f"{_f(a)}|{_f(b)}" for a, b in zip(r["best_score"], r["best_skipping_score"]))
        print(f"{name:10s} {both}  best skipping speedup {_f(r['best_skipping_speedup'])}  "
              f"decoded to the end {r['decoded to the end']}, stopped early or screened out "
              f"{r['stopped early or screened out']}  mean skipped {r['mean_skipped']:.1f}  "
              f"wall {r['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"counts": counts, "results": results}, handle, indent=2)


def _f(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
