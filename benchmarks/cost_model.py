"""The cost model against measurement (a benchmark script, not a test: run it on a quiet machine).

Part 1, profiles: the model's profile from its real weights and from its config alone (random
weights) at --profile-contexts (default 64,2048): one-token forward, one attention sublayer and
verification of 9 tokens at each context. The two should agree within noise, and attention
should cost more at the longer context.

Part 2, prediction versus measurement: the decode-time speedup of self-speculative decoding
over skipsearch's own plain decoding (prefill left out of both), measured and predicted by a
profile of this device, for fixed and adaptive drafting, several skip sets, and two context
lengths (the built-in prompts as they are, and the same prompts behind a filler of
--long-context tokens). Measurement is paired and interleaved: each repeat decodes every prompt
plainly and with every method in turn, in an order that rotates per repeat, and the speedup is
the ratio within that repeat; the table gives the median and range over --repeats repeats.

    python benchmarks/cost_model.py                                   # default model, about 25 min on 2 CPU cores
    python benchmarks/cost_model.py --skip-sets "a20;a16,20,24" --long-context 1024 --json studies/cost_model.json
    python benchmarks/cost_model.py --model PATH --dtype bfloat16     # e.g. on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from tqdm.auto import tqdm

from skipsearch import load_model
from skipsearch.costs.profiler import format_profile, profile_costs
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.stats import DecodeStats
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, model_from_config

from decode_speed import parse_skip_sets


def long_prompts(tokenizer, texts: list[str], target_tokens: int) -> list[list[int]]:
    """Each prompt behind a filler of the other prompts, repeated up to about `target_tokens` tokens."""
    filler = ""
    while len(tokenizer(filler)["input_ids"]) < target_tokens:
        filler += "\n\n".join(texts) + "\n\n"
    ids = tokenizer(filler)["input_ids"][:target_tokens]
    filler = tokenizer.decode(ids)
    return [encode_prompt(tokenizer, f"Background notes:\n{filler}\n\nQuestion: {text}") for text in texts]


def profiles_part(args, loaded) -> list[dict]:
    contexts = [int(c) for c in args.profile_contexts.split(",")]
    real = profile_costs(loaded.model, contexts=contexts, repeats=args.profile_repeats, calibrate=False,
                         show_progress=True)
    random = model_from_config(args.model, device=str(loaded.device), dtype=loaded.dtype_name)
    config_only = profile_costs(random, contexts=contexts, repeats=args.profile_repeats, calibrate=False,
                                show_progress=True)
    del random
    print("\n## Real weights versus the config alone (ms)\n")
    print("| context | forward, real | forward, config only | ratio | attention, real | attention, config only "
          "| verify 9, real | verify 9, config only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for r, c in zip(real.contexts, config_only.contexts):
        row = {"context": r.context_tokens, "forward_real_ms": r.verify_s[0] * 1e3,
               "forward_config_only_ms": c.verify_s[0] * 1e3, "attn_real_ms": r.attn_s * 1e3,
               "attn_config_only_ms": c.attn_s * 1e3, "verify9_real_ms": r.verify_s[-1] * 1e3,
               "verify9_config_only_ms": c.verify_s[-1] * 1e3}
        rows.append(row)
        print(f"| {r.context_tokens} | {row['forward_real_ms']:.2f} | {row['forward_config_only_ms']:.2f} | "
              f"{c.verify_s[0] / r.verify_s[0]:.3f} | {row['attn_real_ms']:.3f} | {row['attn_config_only_ms']:.3f} | "
              f"{row['verify9_real_ms']:.2f} | {row['verify9_config_only_ms']:.2f} |")
    return rows


def measure(model, prompts, methods, max_new_tokens, eos, repeats) -> dict[str, tuple[list[float], DecodeStats]]:
    """Per method: the plain-over-method decode-time ratio of each repeat, and the decode stats of one repeat."""
    names = list(methods)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    stats: dict[str, DecodeStats] = {}

    def decode(skip, policy, prompt) -> DecodeStats:
        return generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy,
                        eos_token_id=eos).stats

    for name in names:  # warm-up
        decode(*methods[name], prompts[0])
    decode(None, DraftPolicy(), prompts[0])
    for repeat in tqdm(range(repeats), desc="paired repeats"):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        plain_s = {name: 0.0 for name in names}
        method_s = {name: 0.0 for name in names}
        for prompt in prompts:
            for name in order:
                # Plain decoding right before each method: the pair shares the machine's state.
                plain = decode(None, DraftPolicy(), prompt)
                one = decode(*methods[name], prompt)
                plain_s[name] += plain.wall_time_s - plain.prefill_time_s
                method_s[name] += one.wall_time_s - one.prefill_time_s
                if repeat == 0:
                    stats.setdefault(name, DecodeStats()).add(one)
        for name in names:
            ratios[name].append(plain_s[name] / method_s[name])
    return {name: (ratios[name], stats[name]) for name in names}


def prediction_part(args, loaded) -> list[dict]:
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = model.generation_config.eos_token_id
    texts = load_prompts(num_prompts=args.num_prompts, seed=0)
    settings = {"short": [encode_prompt(tokenizer, t) for t in texts],
                "long": long_prompts(tokenizer, texts, args.long_context)}
    # The two ends of every context decoded: costs are linear in the context between them, and far-apart
    # points keep timing noise out of the slope.
    spans = sorted({n for prompts in settings.values() for p in prompts for n in (len(p), len(p) + args.max_new_tokens)})
    contexts = [spans[0], spans[-1]]
    if args.profile_from_config:
        profiled = model_from_config(args.model, device=str(loaded.device), dtype=loaded.dtype_name)
    else:
        profiled = model
    profile = profile_costs(profiled, contexts=contexts, repeats=args.profile_repeats, show_progress=True)
    print("\n## The profile used for predictions\n")
    print(format_profile(profile))
    skip_sets = parse_skip_sets(args.skip_sets, model.config.num_hidden_layers)
    policies = {f"fixed k={args.max_draft_tokens}": DraftPolicy(max_draft_tokens=args.max_draft_tokens, adaptive=False),
                "adaptive": DraftPolicy(max_draft_tokens=8)}
    methods = {f"{skip} {label}": (skip, policy) for skip in skip_sets for label, policy in policies.items()}
    rows = []
    for setting, prompts in settings.items():
        mean_context = statistics.mean(len(p) for p in prompts) + args.max_new_tokens / 2
        results = measure(model, prompts, methods, args.max_new_tokens, eos, args.repeats)
        for name, (ratios, stats) in results.items():
            skip, policy = methods[name]
            predicted = profile.predict_speedup(skip, stats, adaptive=policy.adaptive)
            measured = statistics.median(ratios)
            rows.append({"context": setting, "mean_context_tokens": mean_context, "method": name,
                         "acceptance_rate": stats.acceptance_rate, "mean_accepted_tokens": stats.mean_accepted_tokens,
                         "measured_median": measured, "measured_min": min(ratios), "measured_max": max(ratios),
                         "predicted": predicted, "error": predicted / measured - 1})
    print(f"\n## Prediction versus measurement: decode-time speedup over plain decoding, {args.num_prompts} prompts x "
          f"{args.max_new_tokens} new tokens, median [range] of {args.repeats} paired repeats\n")
    print("| context | method | acceptance | mean accepted / round | measured | predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['context']} (~{r['mean_context_tokens']:.0f} tokens) | {r['method']} | {r['acceptance_rate']:.2f} | "
              f"{r['mean_accepted_tokens']:.2f} | {r['measured_median']:.3f} [{r['measured_min']:.3f}, "
              f"{r['measured_max']:.3f}] | {r['predicted']:.3f} | {r['error'] * 100:+.1f}% |")
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nlargest error {worst * 100:.1f}% ({'within' if worst <= 0.05 else 'OUTSIDE'} the 5% target)")
    return rows, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="(default: the embedded default model)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="paired repeats of the measurement")
    parser.add_argument("--skip-sets", default="a20;a16,20,24|m22")
    parser.add_argument("--max-draft-tokens", type=int, default=4, help="fixed drafting's k")
    parser.add_argument("--long-context", type=int, default=1024, help="filler tokens before each long prompt")
    parser.add_argument("--profile-contexts", default="64,2048", help="contexts of part 1 (real vs config only)")
    parser.add_argument("--profile-repeats", type=int, default=20)
    parser.add_argument("--profile-from-config", action="store_true",
                        help="predict with a profile of the config alone (random weights)")
    parser.add_argument("--skip-part1", action="store_true", help="only the prediction-versus-measurement table")
    parser.add_argument("--json", default=None, help="also write every row here")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype)
    print(f"model {loaded.name_or_path} on {loaded.device} ({loaded.dtype_name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    profile_rows = [] if args.skip_part1 else profiles_part(args, loaded)
    rows, profile = prediction_part(args, loaded)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"settings": vars(args), "profiles": profile_rows, "rows": rows,
                       "profile": profile.to_dict()}, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
