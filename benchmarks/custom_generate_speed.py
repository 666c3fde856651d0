"""transformers' `generate` with `custom_generate=self_speculative(...)` beside plain HF greedy and the bare loop.

On the same prompts, interleaved per prompt and repeat: HF greedy (`model.generate`), HF greedy
through `self_speculative` (logits processors per position, stopping criteria per committed
token), and `skipsearch.generate` with the same skip set (no hooks). Prints tokens/s of each, the
speedup over HF greedy, the cost of the hooks (self_speculative over the bare loop) and whether
outputs equal HF's. `--repetition-penalty` adds a history-dependent processor to both HF runs
(the bare loop has none then, so read the hooks' cost from a run without it).

    python benchmarks/custom_generate_speed.py --skip-attn 20 --max-new-tokens 64
    python benchmarks/custom_generate_speed.py --skip-attn 20 --repetition-penalty 1.2
    python benchmarks/custom_generate_speed.py --device cuda --dtype bfloat16 --skip-attn 16,20,24 --skip-mlp 22
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skipsearch import DraftPolicy, SkipSet, generate, load_model, self_speculative
from skipsearch.decode.steps import synchronize
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-attn", default="20", help="comma-separated layer ids whose attention the draft skips")
    parser.add_argument("--skip-mlp", default="", help="comma-separated layer ids whose MLP the draft skips")
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    skip = SkipSet.of([int(i) for i in args.skip_attn.split(",") if i], [int(i) for i in args.skip_mlp.split(",") if i],
                      model.config.num_hidden_layers)
    policy = DraftPolicy(max_draft_tokens=args.max_draft_tokens)
    speculative = self_speculative(skip, policy)
    options = dict(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    prompts = [encode_prompt(tokenizer, text) for text in load_prompts(num_prompts=args.num_prompts)]

    def hf(ids):
        return model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0, ids.shape[1]:].tolist()

    def through_custom_generate(ids):
        return model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=speculative,
                              **options)[0, ids.shape[1]:].tolist()

    def bare_loop(ids):
        return generate(model, ids[0], skip=skip, policy=policy, max_new_tokens=args.max_new_tokens).tokens

    methods = {"HF greedy": hf, "HF + self_speculative": through_custom_generate, "skipsearch.generate": bare_loop}
    rates = {name: [] for name in methods}
    same = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        for method in methods.values():
            method(ids)  # warm-up: allocations, first-call paths
        for repeat in range(args.repeats):
            outputs = {}
            for name, method in methods.items():
                synchronize(model.device)
                start = time.perf_counter()
                outputs[name] = method(ids)
                synchronize(model.device)
                rates[name].append(len(outputs[name]) / (time.perf_counter() - start))
            same += repeat == 0 and outputs["HF + self_speculative"] == outputs["HF greedy"]
    base = statistics.median(rates["HF greedy"])
    for name, values in rates.items():
        print(f"{name:24s} {statistics.median(values):8.1f} tok/s   x{statistics.median(values) / base:.2f}")
    hooks = statistics.median(rates["HF + self_speculative"]) / statistics.median(rates["skipsearch.generate"])
    print(f"self_speculative / bare loop: x{hooks:.2f}   identical to HF greedy: {same}/{len(prompts)}   "
          f"acceptance {speculative.stats.acceptance_rate}")


if __name__ == "__main__":
    main()
