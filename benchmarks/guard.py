"""The run-time guard and the stop rules (issue 18), paired against plain decoding on held-out prompts.

For each skip set: today's default policy unguarded (Draft & Verify's adaptive threshold with our
constants: 0.6, target 0.7, step 0.05), the same guarded (the new default), Draft & Verify's own
constants (0.8, target 0.9, step 0.01) unguarded, and the cost rule unguarded and guarded. Every
method decodes every prompt back to back with plain decoding in a rotating order (bench.timed_runs);
a speedup is the geometric mean of the paired per-run ratios over plain decoding (decode time, the
prefill excluded), with its 95% interval. Every output is compared with plain decoding's.

    python benchmarks/guard.py --sets "a8;a8,11,18,20,22,28|m24,26,28" --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skipsearch import load_model
from skipsearch.bench import skipsearch_decoder, timed_runs
from skipsearch.data import load_prompts
from skipsearch.decoding import DraftPolicy
from skipsearch.guard import Guard, PlainSpeed
from skipsearch.measure import ratio_interval
from skipsearch.models import encode_prompt

from decode_speed import parse_skip_sets

POLICIES = {
    "threshold (today's default), unguarded": DraftPolicy(guard=False),
    "threshold, guarded (new default)": DraftPolicy(),
    "D&V's constants, unguarded": DraftPolicy(confidence_threshold=0.8, target_acceptance=0.9, threshold_step=0.01,
                                              guard=False),
    "cost rule, unguarded": DraftPolicy(stop_rule="cost", guard=False),
    "cost rule, guarded": DraftPolicy(stop_rule="cost"),
}


def guard_microseconds(rounds: int = 200_000) -> float:
    """What the guard adds to a round on the host: one clock read and one update, timed over many rounds."""
    guard = Guard(PlainSpeed(1.0))
    start = time.perf_counter()
    for _ in range(rounds):
        guard.observe(3, time.perf_counter() - start, drafted=True)
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--sets", default="a8;a8,11,18,20,22,28|m24,26,28", help="skip sets, decode_speed.py's syntax")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-offset", type=int, default=8, help="held out: the default study uses the first 8")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="compiled steps (on CUDA: CUDA graphs), as deployed")
    parser.add_argument("--policies", default=",".join(str(i) for i in range(len(POLICIES))),
                        help="which of the policies, by index (default: all)")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, eos = loaded.model, loaded.model.generation_config.eos_token_id
    texts = load_prompts(num_prompts=args.prompt_offset + args.num_prompts, seed=0)[args.prompt_offset:]
    prompts = [encode_prompt(loaded.tokenizer, text) for text in texts]
    chosen = [list(POLICIES.items())[int(i)] for i in args.policies.split(",")]
    decoders = {"plain": skipsearch_decoder(model, args.max_new_tokens, eos, None, DraftPolicy(), compile=args.compile)}
    for skip in parse_skip_sets(args.sets, model.config.num_hidden_layers):
        for label, policy in chosen:
            decoders[f"{skip}: {label}"] = skipsearch_decoder(model, args.max_new_tokens, eos, skip, policy,
                                                              compile=args.compile)
    print(f"{loaded.name_or_path} on {model.device} ({model.dtype}, {'compiled' if args.compile else 'eager'}), "
          f"torch threads {torch.get_num_threads()}, {len(prompts)} held-out prompts "
          f"x {args.max_new_tokens} new tokens, {args.repeats} repeats, paired against plain decoding")
    print(f"the guard's bookkeeping: {guard_microseconds():.2f} us per round (a clock read and its update)")
    runs = timed_runs(decoders, prompts, args.repeats, model.device, show_progress=True)
    plain = runs["plain"]
    print("| method | tok/s | vs plain (95% interval) | acceptance | drafted / round | guard: plain tokens | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, run in runs.items():
        ratio = ratio_interval(run.ratios_over(plain, decode_only=True))
        stats = run.stats
        acceptance = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
        per_round = f"{stats.drafted / stats.rounds:.2f}" if stats.rounds else "-"
        guarded = f"{stats.guard.plain_tokens} of {stats.new_tokens}" if name != "plain" else "-"
        print(f"| {name} | {statistics.fmean(n / s for n, s in zip(run.tokens, run.seconds)):.1f} | "
              f"{ratio.estimate:.2f}x ({ratio.low:.2f}-{ratio.high:.2f}) | {acceptance} | {per_round} | {guarded} | "
              f"{run.outputs == plain.outputs} |")


if __name__ == "__main__":
    main()
