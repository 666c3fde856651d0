"""A verification's head on a CPU: the model's own linear head against the one packed for oneDNN (decode/packed.py).

Two measurements on one model, paired and interleaved, each with its 95% interval:
1. the LM head's matmul alone for 1 to 9 rows (a round's verification of up to 8 drafts): the model's head over the
   packed one at the same rows, and each one's time over the model's head for one row (a plain step's head);
2. the eager verify step (the full model's forward over a round's tokens, at a context of the prompt): the model itself
   over the packed verifier the engine runs, and each one's time over the plain one-token step.

    python benchmarks/verify_head.py --model gemma-3-270m --repeats 20
    python benchmarks/verify_head.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skipsearch.decode.engine import engine_for
from skipsearch.decode.packed import packed_head
from skipsearch.decode.skipping import model_with_head
from skipsearch.decode.steps import forward_at_position
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, load_model, model_from_config
from skipsearch.search.measure import ratio_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--config-only", default=None, help="a config to build with random weights instead")
    parser.add_argument("--widths", default="1,2,3,5,9", help="rows verified at once (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="paired timings of each kind (default: 20)")
    args = parser.parse_args()
    if args.config_only:
        model, name = model_from_config(args.config_only, device="cpu", dtype="float32").eval(), args.config_only
        prompt = list(range(1, 65))
    else:
        loaded = load_model(args.model, device="cpu", dtype="float32")
        model, name = loaded.model, loaded.name_or_path
        prompt = encode_prompt(loaded.tokenizer, load_prompts(num_prompts=1, seed=0)[0])
    weight, bias = model.get_output_embeddings().weight, model.get_output_embeddings().bias
    packed = packed_head(weight, bias)
    if packed is None:
        raise SystemExit("the packed head does not apply here (decode/packed.py): nothing to compare")
    widths = [int(w) for w in args.widths.split(",")]
    print(f"{name}: head {tuple(weight.shape)}, float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    head_matmul(model.get_output_embeddings(), packed, widths, args.repeats)
    verify_steps(model, packed, prompt, widths, args.repeats)


def pair(a, b, repeats: int):
    """Time `a` and `b` back to back `repeats` times, the order alternating: (a's time over b's, paired, as an
    interval; a's median seconds; b's)."""
    ratios, seconds = [], {"a": [], "b": []}
    for i in range(repeats):
        times = {}
        for label, fn in [("a", a), ("b", b)][:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            fn()
            times[label] = time.perf_counter() - start
            seconds[label].append(times[label])
        ratios.append(times["a"] / times["b"])
    return ratio_interval(ratios), statistics.median(seconds["a"]), statistics.median(seconds["b"])


def report(w: int, run, own, packed, unit, repeats: int, what: str) -> None:
    """One width's row: own over packed, and each over `unit` (one row of the own head, or a plain step)."""
    ratio, own_s, packed_s = pair(run(own, w), run(packed, w), repeats)
    own_unit, _, unit_s = pair(run(own, w), unit, repeats)
    packed_unit, _, _ = pair(run(packed, w), unit, repeats)
    print(f"  {w} rows: own {own_s * 1e3:.1f} ms = {_x(own_unit)} {what}; packed {packed_s * 1e3:.1f} ms = "
          f"{_x(packed_unit)}; own over packed {_x(ratio)}")


@torch.inference_mode()
def head_matmul(head, packed, widths, repeats) -> None:
    hidden = {w: torch.randn(1, w, head.weight.shape[1]) for w in {1, *widths}}

    def run(module, w):
        return lambda: module(hidden[w])

    print("\nthe head's matmul alone (medians; paired ratios with 95% intervals)")
    for w in widths:
        report(w, run, head, packed, run(head, 1), repeats, "the own head's one row")


@torch.inference_mode()
def verify_steps(model, packed, prompt, widths, repeats) -> None:
    cache = engine_for(model).cache_for(len(prompt) + max(widths) + 1, None)
    forward_at_position(model, cache, torch.tensor([prompt]))
    position = int(cache.position)
    ids = torch.tensor([prompt[-max(widths):]])

    def run(module, width):
        def call():
            cache.seek(position)
            forward_at_position(module, cache, ids[:, :width])
        return call

    print(f"\neager verify steps, the full model over a round's tokens at a context of {position} (medians; paired "
          "ratios with 95% intervals)")
    for w in widths:
        report(w, run, model, model_with_head(model, packed), run(model, 1), repeats, "a plain step")


def _x(interval) -> str:
    return f"{interval.estimate:.2f}x ({interval.low:.2f}-{interval.high:.2f})"


if __name__ == "__main__":
    main()
