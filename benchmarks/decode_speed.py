"""Decode speed on one model, all ratios from one run (a benchmark script, not a test).

Prints HF `generate` greedy tokens/s, skipsearch's plain (autoregressive) loop tokens/s, and
self-speculative decoding with a few skip sets: tokens/s, speedup over HF greedy, acceptance,
mean accepted tokens per round, the draft cost (one draft forward / one full forward) measured
in the loop, against the plain loop's forwards in the same passes, and from the cost profile, and the decode-time speedup over the plain loop measured
and predicted by the cost model (prefill, the same work in both, left out of both). Passes
are interleaved across methods; each figure is the median of --repeats passes.

    python benchmarks/decode_speed.py                       # default model, 4 prompts x 48 tokens
    python benchmarks/decode_speed.py --model PATH --num-prompts 2 --max-new-tokens 24 --skip-sets "a20;a16,20,24"
"""

from __future__ import annotations

import argparse
import json

import torch

from skipsearch import load_model
from skipsearch.costs.profiler import contexts_for, profile_costs
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt
from skipsearch.report.bench import hf_decoder, skipsearch_decoder, timed_runs
from skipsearch.search.measure import ratio_interval


def parse_skip_sets(text: str, num_layers: int) -> list[SkipSet]:
    """'a20;a16,20,24|m22' -> attention 20; attention 16, 20, 24 and MLP 22; '' -> no sets (plain rows only)."""
    sets = []
    for spec in filter(None, text.split(";")):
        attn, mlp = [], []
        for part in spec.split("|"):
            ids = [int(i) for i in part[1:].split(",") if i]
            (attn if part.startswith("a") else mlp).extend(ids)
        sets.append(SkipSet.of(attn, mlp, num_layers))
    return sets


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --config-only, --device and --dtype, as the benchmark scripts take them (`load_for_benchmark`)."""
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--config-only", default=None, help="a config .json: random weights of that shape")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: bfloat16 on CUDA, else float32)")


def load_for_benchmark(args: argparse.Namespace):
    """(model, its name, its tokenizer or None) from `add_model_arguments`' flags."""
    from skipsearch.io.models import load_model, model_from_config

    if args.config_only:
        return model_from_config(args.config_only, device=args.device, dtype=args.dtype), args.config_only, None
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    return loaded.model, loaded.name_or_path, loaded.tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-sets", default="a20;a16,20,24;a15,17,19,21,23,25,27")
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=args.dtype)
    model, eos = loaded.model, loaded.model.generation_config.eos_token_id
    prompts = [encode_prompt(loaded.tokenizer, p) for p in load_prompts(num_prompts=args.num_prompts, seed=0)]
    n = args.max_new_tokens
    print(f"model {loaded.name_or_path} on {loaded.device} ({loaded.dtype_name}), torch threads "
          f"{torch.get_num_threads()}, {len(prompts)} prompts x {n} new tokens, {args.repeats} repeats, paired runs")
    profile = profile_costs(model, contexts=contexts_for(model, prompts, n))

    skip_sets = parse_skip_sets(args.skip_sets, model.config.num_hidden_layers)
    policies = {"fixed k": DraftPolicy(max_draft_tokens=args.max_draft_tokens, adaptive=False),
                "adaptive": DraftPolicy(max_draft_tokens=8)}
    decoders = {"HF generate greedy": hf_decoder(model, n, eos),
                "skipsearch plain loop": skipsearch_decoder(model, n, eos, None, DraftPolicy())}
    runs = {}
    for skip in skip_sets:
        for label, policy in policies.items():
            name = f"self-spec {skip} ({label}{' ' + str(args.max_draft_tokens) if label == 'fixed k' else ''})"
            # Draft forwards are timed inside the same passes (their syncs cost nothing on a CPU).
            decoders[name] = skipsearch_decoder(model, n, eos, skip, policy, time_drafts=True)
            runs[name] = (skip, policy)
    results = timed_runs(decoders, prompts, args.repeats, model.device, show_progress=True)
    hf, plain = results["HF generate greedy"], results["skipsearch plain loop"]
    # Plain decoding spends one forward per token after the first, which comes from the prefill.
    plain_forward = (sum(plain.seconds) - sum(plain.prefill_seconds)) / (sum(plain.tokens) - len(plain.tokens))
    rows = []
    for name, run in results.items():
        stats = run.stats
        row = {"method": name, "tok/s": sum(run.tokens) / sum(run.seconds),
               "speedup": ratio_interval(run.ratios_over(hf)).estimate, "identical": run.outputs == hf.outputs}
        if name in runs:
            skip, policy = runs[name]
            row.update({
                "acceptance": stats.acceptance_rate, "mean accepted": stats.mean_accepted_tokens,
                "draft cost": stats.draft_time_s / stats.drafted / plain_forward if stats.drafted else None,
                "draft cost (profile)": profile.draft_s(skip) / profile.forward_s,
                "decode vs plain": ratio_interval(run.ratios_over(plain, decode_only=True)).estimate,
                "predicted": profile.predict_speedup(skip, stats, adaptive=policy.adaptive),
            })
        rows.append(row)
    columns = ["method", "tok/s", "speedup", "acceptance", "mean accepted", "draft cost", "draft cost (profile)",
               "decode vs plain", "predicted", "identical"]
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))
    print(f"verify cost (profile): 1 token {profile.contexts[0].verify_s[0] * 1e3:.1f} ms, 5 tokens "
          f"{profile.contexts[0].verify_s[4] * 1e3:.1f} ms, 9 tokens {profile.contexts[0].verify_s[8] * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "profile": vars(profile)}, handle, indent=2)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


if __name__ == "__main__":
    main()
