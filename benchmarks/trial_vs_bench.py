"""Does a study's figure for a skip set agree with what `bench` then measures? (a benchmark script)

For each skip set, measures its paired speedup over plain decoding twice, on the same prompts:
as a study's trial does (`evaluation.Evaluator.evaluate`, compiled steps as `optimize` runs them) and as
`bench --compile` does (`bench.timed_runs` over skipsearch's plain and skip-set decoders), with the same
policy on both sides: the run-time guard off, as a trial runs (`bench` reports that figure beside the guarded
one, its "(unguarded, as its study measured)" row). Prints
both 95% intervals and whether they overlap. On CUDA both run the regional steps as CUDA graphs,
the same steps; on a CPU the study runs regional steps and bench frozen ones (the CPU's
deployment mode), so there the two may differ by design.

    python benchmarks/trial_vs_bench.py --device cuda --dtype bfloat16 --skip-sets "a20;a16,20,24;a8,12,16,20,24|m22"
"""

from __future__ import annotations

import argparse

import torch

from skipsearch.decode.policy import DraftPolicy
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, load_model
from skipsearch.report.bench import skipsearch_decoder, timed_runs
from skipsearch.search.evaluation import Evaluator
from skipsearch.search.measure import ratio_interval

from decode_speed import parse_skip_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: bfloat16 on CUDA, else float32)")
    parser.add_argument("--skip-sets", default="a20;a16,20,24;a8,12,16,20,24|m22",
                        help="';'-separated skip sets, 'a' attention and '|m' MLP layer lists (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=4, help="built-in prompts (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="paired runs per prompt, both sides (default: 3)")
    parser.add_argument("--bench-mode", choices=["deployed", "regional"], default="deployed",
                        help="bench's compiled steps: those `bench --compile` runs (on a CPU frozen, one compile per "
                             "set), or the regional ones a study runs, to tell the engine's share of a disagreement "
                             "from the rest (default: %(default)s)")
    args = parser.parse_args()
    bench_mode = "regional" if args.bench_mode == "regional" else None

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, eos = loaded.model, loaded.model.generation_config.eos_token_id
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompts(num_prompts=args.num_prompts, seed=0)]
    policy = DraftPolicy(guard=False)  # what a trial measures (evaluation.py): like with like
    evaluator = Evaluator(model, prompts, args.max_new_tokens, policy, eos, repeats=args.repeats, compile=True)
    print(f"{loaded.name_or_path} on {model.device} ({loaded.dtype_name}), {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, {args.repeats} paired runs per prompt, default policy, guard off on both sides; "
          f"bench's steps: {args.bench_mode}")
    print(f"{'skip set':44} {'study (95% interval)':>24} {'bench (95% interval)':>24}  overlap")
    plain = skipsearch_decoder(model, args.max_new_tokens, eos, None, policy, compile=True, compile_mode=bench_mode)
    for skip in parse_skip_sets(args.skip_sets, model.config.num_hidden_layers):
        study = evaluator.evaluate(skip).speedup
        decoders = {"plain": plain, "set": skipsearch_decoder(model, args.max_new_tokens, eos, skip, policy,
                                                               compile=True, compile_mode=bench_mode)}
        runs = timed_runs(decoders, prompts, args.repeats, model.device)
        bench = ratio_interval(runs["set"].ratios_over(runs["plain"]))
        overlap = study.low <= bench.high and bench.low <= study.high
        span = lambda i: f"{i.estimate:.3f}x ({i.low:.3f}-{i.high:.3f})"  # noqa: E731
        print(f"{str(skip):44} {span(study):>24} {span(bench):>24}  {'yes' if overlap else 'NO'}", flush=True)
    if torch.cuda.is_available():
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
