"""How long the rounds of CUDA's decoding path are, and what they would cost on memory-bound hardware: counted on
a CPU with the default model's real weights, since acceptance depends on the weights and the counts on nothing else.

Where a read stalls the device (CUDA), a round cannot stop at its first unsure draft without reading the draft's
confidence back; skipsearch runs that path on a CPU too when told reads stall (`loop.host_reads_stall`). Per
skip set, greedy decoding of held-out prompts through the CPU's path (a host read per draft, cut at an unsure
one) and through CUDA's path, with the counts of each: rounds, draft forwards, accepted drafts.

The cost is modeled, not timed: a round costs one plain step for its verification (memory-bound: verifying up
to 9 tokens reads the weights once, as one token does) plus, per draft forward, the share of the weights the draft
reads (`economics.weight_fraction`); plain decoding costs one step a token; host work is left out. The price the
loop itself uses for a draft is pinned to that share, as it would measure on such hardware, so that this CPU's
timings (where a draft costs about a full forward) do not enter.

    python benchmarks/draft_length.py --sets "a8;a20;a8,11,18,20,22,28|m24,26,28" --max-new-tokens 96
"""

from __future__ import annotations

import argparse

import torch

from skipsearch import load_model
from skipsearch.decode import economics, loop as decoding
from skipsearch.decode.economics import weight_fraction
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt

from decode_speed import parse_skip_sets


def counts(model, prompts, skip, max_new_tokens: int, reads_stall: bool) -> decoding.DecodeStats:
    """Greedy decoding of every prompt through the CPU's path or CUDA's; the statistics summed."""
    decoding.host_reads_stall = lambda device: reads_stall
    total = decoding.DecodeStats()
    for prompt in prompts:
        out = generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=DraftPolicy(guard=False),
                       eos_token_id=None)
        total.add(out.stats)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="a8;a20;a16,20,24;a8,12,16,20,24|m22;a8,11,18,20,22,28|m24,26,28",
                        help="skip sets, decode_speed.py's syntax")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-offset", type=int, default=8, help="held out: the default study uses the first 8")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    economics.PriceFit.units = lambda self: None  # rounds priced by the weight share alone: see the docstring
    loaded = load_model(device="cpu", dtype="float32")
    model = loaded.model
    texts = load_prompts(num_prompts=args.prompt_offset + args.num_prompts, seed=0)[args.prompt_offset:]
    prompts = [encode_prompt(loaded.tokenizer, text) for text in texts]
    print(f"default model, fp32, torch {torch.__version__}, {len(prompts)} held-out prompts x {args.max_new_tokens} "
          "new tokens, greedy, DraftPolicy() unguarded; cost modeled as memory-bound (see the docstring)")
    print("| skip set | draft's weight share | path | rounds | drafts run / round | accepted / round | "
          "acceptance | modeled speed vs plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for skip in parse_skip_sets(args.sets, model.config.num_hidden_layers):
        share = weight_fraction(model, skip)
        for path, stall in (("CPU: cut at the first unsure draft", False), ("CUDA: no read mid-round", True)):
            stats = counts(model, prompts, skip, args.max_new_tokens, stall)
            forwards = getattr(stats, "draft_forwards", stats.drafted)  # earlier releases ran drafts past the cut
            steps = stats.rounds + forwards * share  # the first token comes from the prefill: not counted
            print(f"| {skip} | {share:.3f} | {path} | {stats.rounds} | {forwards / stats.rounds:.2f} | "
                  f"{stats.accepted / stats.rounds:.2f} | {stats.acceptance_rate:.2f} | "
                  f"{(stats.new_tokens - len(prompts)) / steps:.2f}x |")


if __name__ == "__main__":
    main()
