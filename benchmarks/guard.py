"""The draft controller (issue 27) against the best fixed draft length, paired against plain decoding on held-out
prompts.

For each skip set: the default policy (the controller, guarded), the controller unguarded, and fixed draft lengths 1,
2 and 4 (unguarded: what the length itself gives). Every method decodes every prompt back to back with plain decoding
in a rotating order (bench.timed_runs); a speedup is the geometric mean of the paired per-run ratios over plain
decoding (decode time, the prefill excluded), with its 95% interval. Every output is compared with plain decoding's.
Each method keeps one `DraftMemory` across its calls, as a server keeps one per model. With `--cost-profile`, one more
row: the default policy priced by that profile, which pads verifications to the cheapest measured width (what padding
buys, paired against the row without it). The figures are a server's first calls, where the guard still learns;
`--learned N` decodes every prompt N times untimed first, for its steady state.

    python benchmarks/guard.py --sets "a8;a8,11,18,20,22,28|m24,26,28;a4,8,11,15,18,20,22,24,28" --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from skipsearch import load_model
from skipsearch.cli.arguments import number
from skipsearch.decode.controller import DraftController, DraftMemory
from skipsearch.decode.cost_profile import CostProfile
from skipsearch.decode.economics import RoundCosts
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt
from skipsearch.report.bench import timed_runs
from skipsearch.search.measure import ratio_interval

from decode_speed import parse_skip_sets

POLICIES = {
    "controller, guarded (default)": DraftPolicy(),
    "controller, unguarded": DraftPolicy(guard=False),
    **{f"fixed k={k}, unguarded": DraftPolicy(max_draft_tokens=k, adaptive=False, guard=False) for k in (1, 2, 4)},
}


def controller_microseconds(rounds: int = 200_000) -> float:
    """What the controller adds to a round on the host: a plan, a clock read and an observation, timed over many."""
    controller = DraftController(DraftPolicy(), DraftMemory(plain_s={"eager": 1.0}))
    controller.use(SkipSet.of([1]), RoundCosts(draft=0.3))
    start = time.perf_counter()
    for _ in range(rounds):
        drafts = controller.plan(room=100)
        controller.observe(drafts, drafts, drafts + 1, time.perf_counter() - start)
    return (time.perf_counter() - start) / rounds * 1e6


def decoder(model, max_new_tokens, eos, skip, policy, compile, profile=None):
    """One method: `generate` with a memory of its own across calls (a server's), `profile` pricing its rounds."""
    memory = DraftMemory()

    def decode(prompt: list[int]):
        out = generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy, eos_token_id=eos,
                       compile=compile, cost_profile=profile, memory=memory)
        return out.tokens, out.stats

    return decode


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
    parser.add_argument("--learned", type=number(int, lambda v: v >= 0, "an integer >= 0"), default=0,
                        metavar="PASSES",
                        help="untimed passes over the prompts first, so that each method's memory has learned what a "
                             "long-running server's has (back-offs, plain speed): its steady state, not its first "
                             "calls (default: %(default)s)")
    parser.add_argument("--cost-profile", default=None,
                        help="a profile of this device (python -m skipsearch profile): adds the default policy priced "
                             "and padded by it")
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, eos = loaded.model, loaded.model.generation_config.eos_token_id
    texts = load_prompts(num_prompts=args.prompt_offset + args.num_prompts, seed=0)[args.prompt_offset:]
    prompts = [encode_prompt(loaded.tokenizer, text) for text in texts]
    chosen = [list(POLICIES.items())[int(i)] for i in args.policies.split(",")]
    profile = CostProfile.load(args.cost_profile) if args.cost_profile else None
    decoders = {"plain": decoder(model, args.max_new_tokens, eos, None, DraftPolicy(), args.compile)}
    for skip in parse_skip_sets(args.sets, model.config.num_hidden_layers):
        for label, policy in chosen:
            decoders[f"{skip}: {label}"] = decoder(model, args.max_new_tokens, eos, skip, policy, args.compile)
        if profile is not None:
            decoders[f"{skip}: controller, guarded, padded by the profile"] = decoder(
                model, args.max_new_tokens, eos, skip, DraftPolicy(), args.compile, profile)
    print(f"{loaded.name_or_path} on {model.device} ({model.dtype}, {'compiled' if args.compile else 'eager'}), "
          f"torch threads {torch.get_num_threads()}, {len(prompts)} held-out prompts "
          f"x {args.max_new_tokens} new tokens, {args.repeats} repeats after {args.learned} untimed passes, "
          f"paired against plain decoding")
    print(f"the controller's bookkeeping: {controller_microseconds():.2f} us per round (a plan, a clock read, an update)")
    for _ in tqdm(range(args.learned), desc="untimed passes (learning)"):
        for decode in decoders.values():
            for prompt in prompts:
                decode(prompt)
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
