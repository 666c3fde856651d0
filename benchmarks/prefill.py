"""The compiled prefill against the eager one, paired (a benchmark script, not a test).

Both run the engine's regional steps' cache: the eager prefill is one forward of the whole prompt
(what a CPU and the whole-step modes run), the compiled one (what CUDA runs) runs the
prompt at the fixed widths of `steps.PREFILL_WIDTHS`, padded. Each prompt is prefilled by both,
back to back in alternating order, `--repeats` times; prints each one's milliseconds per prompt and
per token, and the paired ratio (eager time / compiled time: above 1 the compiled prefill is faster)
with its 95% interval. The first call of each width (compiling, capturing) is not timed.

    python benchmarks/prefill.py                                   # default model, CPU, fp32, inductor
    python benchmarks/prefill.py --device cuda --dtype bfloat16    # CUDA graphs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skipsearch.decode import engine as engine_module
from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.steps import PREFILL_WIDTHS, Prefill, synchronize
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt
from skipsearch.search.measure import ratio_interval

from decode_speed import add_model_arguments, load_for_benchmark


def timed(prefill: Prefill, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
    prefill.cache.seek(0)
    synchronize(prompt.device)
    start = time.perf_counter()
    logits = prefill(prompt)
    synchronize(prompt.device)
    return time.perf_counter() - start, logits.float().clone()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=8, help="built-in prompts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="paired runs per prompt (default: %(default)s)")
    args = parser.parse_args()

    model, name, tokenizer = load_for_benchmark(args)
    if tokenizer is None:  # random weights: prompts of set lengths
        prompts = [list(range(1, 1 + n)) for n in (37, 90, 150, 300)][: args.num_prompts]
    else:
        prompts = [encode_prompt(tokenizer, p) for p in load_prompts(num_prompts=args.num_prompts, seed=0)]
    engine, settings = engine_for(model), CompileSettings(args.backend, "regional")
    # The compiled prefill on any device, the CPU included, where the engine itself prefills eagerly (it lost there).
    engine_module.COMPILED_PREFILL_DEVICES = frozenset({model.device.type})
    cache = engine.cache_for(max(map(len, prompts)) + 1, settings)
    compiled, eager = engine.steps_for(cache, None, settings, 1).prefill, Prefill(model, cache)
    ids = [torch.tensor([p], device=model.device) for p in prompts]
    for width in PREFILL_WIDTHS:  # set every width up before timing
        timed(compiled, ids[0][:, :width] if ids[0].shape[1] >= width else ids[0].repeat(1, width)[:, :width])
    seconds = {"eager": [], "compiled": []}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(ids):
            order = ("eager", "compiled") if (repeat + i) % 2 == 0 else ("compiled", "eager")
            results = {kind: timed(eager if kind == "eager" else compiled, prompt) for kind in order}
            for kind, (spent, _) in results.items():
                seconds[kind].append(spent)
            # Same logits up to the rounding of other matrix shapes (greedy identity is tested, not timed, here).
            torch.testing.assert_close(results["compiled"][1], results["eager"][1], atol=5e-2, rtol=5e-2)
    tokens = sum(len(p) for p in prompts) * args.repeats
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), {len(prompts)} prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens"
          f"{', made up: random weights' if tokenizer is None else ''}) x {args.repeats} paired runs; compiled at "
          f"widths {', '.join(str(width) for width, _ in sorted(engine.prefill_steps))}")
    for kind, spent in seconds.items():
        print(f"{kind:9} prefill: {1e3 * statistics.fmean(spent):8.1f} ms a prompt, {1e6 * sum(spent) / tokens:7.1f} us a token")
    ratio = ratio_interval([e / c for e, c in zip(seconds["eager"], seconds["compiled"])])
    print(f"eager / compiled: {ratio.estimate:.2f}x (95% interval {ratio.low:.2f}-{ratio.high:.2f})")


if __name__ == "__main__":
    main()
