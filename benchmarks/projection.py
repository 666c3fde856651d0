"""Projections, labelled as such: the speedup over skipsearch's compiled plain decoding that a shipped GPU profile
predicts for published skip sets, as a function of the acceptance rate, with the full LM head and a trimmed one.

Nothing here is measured but the profiles (skipsearch/profiles/, random weights, regional steps as CUDA graphs). The
rounds are made up: every round drafts k tokens, each accepted with probability `acceptance` once those before it
were (economics.committed_tokens), at one context length; k is the best of 1-8 for each cell. A trimmed head is
priced by its rows at the same acceptance, which it cannot raise. For 32-layer shapes, Draft & Verify's LLaMA-2-13B
sets (40 layers) are mapped to 32 layers by position (layer i to round(i * 32 / 40)): labelled "mapped".

    python benchmarks/projection.py                       # the table in BENCHMARKS.md, "Twenty-first session"
    python benchmarks/projection.py --shapes llama-3-8b --context 2048 --head-rows 32768
"""

from __future__ import annotations

import argparse
import collections

from skipsearch.decode.cost_profile import CostProfile
from skipsearch.decode.economics import committed_tokens
from skipsearch.decode.skipset import DraftHead, SkipSet
from skipsearch.decode.stats import DecodeStats
from skipsearch.search.published import published_skip_sets

ACCEPTANCE = (0.6, 0.7, 0.8, 0.9, 0.95)
SETS = ("llama-2-13b", "llama-2-13b_cnndm")  # Draft & Verify's and SWIFT's LLaMA-2-13B sets


def rounds_at(acceptance: float, drafts: int, context: int, rounds: int = 1000) -> DecodeStats:
    """The statistics of `rounds` rounds of `drafts` drafts each at `context`, accepted at `acceptance` on average."""
    stats = DecodeStats(rounds=rounds, drafted=rounds * drafts)
    stats.accepted = round(rounds * (committed_tokens(acceptance, drafts) - 1))
    stats.verify_contexts = collections.Counter({(drafts + 1, context): rounds})
    return stats


def speedup_at(profile: CostProfile, skip: SkipSet, acceptance: float, drafts: int, context: int) -> float:
    """The predicted speedup of decoding that drafts `drafts` tokens a round (its `max_draft_tokens`), verified as the
    profile's steps run: compiled steps verify at that one width, as measured; eager ones at the cheapest width up to
    it."""
    return profile.predict_speedup(skip, rounds_at(acceptance, drafts, context), max_draft_tokens=drafts,
                                   compiled=profile.compiled_steps)


def best_speedup(profile: CostProfile, skip: SkipSet, acceptance: float, context: int) -> tuple[float, int]:
    """The predicted speedup at the best draft length (1-8), and that length."""
    return max((speedup_at(profile, skip, acceptance, k, context), k) for k in range(1, 9))


def skip_sets(num_layers: int) -> dict[str, SkipSet]:
    """The published LLaMA-2-13B sets, each layer mapped by position to `num_layers` (the same layer at 40)."""
    published = {s.name: s for s in published_skip_sets()}
    sets = {}
    for name in SETS:
        entry = published[name]
        ratio = num_layers / entry.model["num_hidden_layers"]
        attn, mlp = ({min(num_layers - 1, round(i * ratio)) for i in ids} for ids in (entry.attn, entry.mlp))
        sets[entry.origin + (", mapped" if ratio != 1 else "")] = SkipSet.of(attn, mlp, num_layers)
    return sets


def table(profile: CostProfile, shape: str, context: int, head_rows: int) -> list[str]:
    sets = skip_sets(profile.num_hidden_layers)
    heads = {"full head": None, f"head of {head_rows:,} rows": DraftHead(tuple(range(head_rows)))}
    columns = [(set_name, head_name, SkipSet.of(skip.attn, skip.mlp, profile.num_hidden_layers, head=head))
               for set_name, skip in sets.items() for head_name, head in heads.items()]
    lines = [f"### {shape}, context {context}: PREDICTED speedup over compiled plain decoding (best draft length)", "",
             f"Profile: {profile.label()}.", "",
             "| acceptance | " + " | ".join(f"{s} ({s_skip.size} sublayers), {h}" for s, h, s_skip in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for acceptance in ACCEPTANCE:
        cells = [best_speedup(profile, skip, acceptance, context) for _, _, skip in columns]
        lines.append(f"| {acceptance:.2f} | " + " | ".join(f"{s:.2f}x (k={k})" for s, k in cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="nvidia-h200", help="the shipped profiles' device (default: %(default)s)")
    parser.add_argument("--shapes", default="llama-2-7b,llama-3-8b,llama-2-13b", help="(default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens cached at each round (default: %(default)s)")
    parser.add_argument("--head-rows", type=int, default=8192, help="a trimmed head's rows (default: %(default)s)")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        profile = CostProfile.load(f"{args.device}/{shape}")
        print("\n".join(table(profile, shape, args.context, args.head_rows)) + "\n")


if __name__ == "__main__":
    main()
