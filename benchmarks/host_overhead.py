"""Host work per token and per round of the decoding loop, split by part (a benchmark script, not a test).

The loop is not instrumented: this script wraps its named pieces from outside with timers that
count each piece's own time (time inside other wrapped pieces is left to those), decodes, and
reports microseconds per token and per round for each part:

- steps: the forwards (`Step.__call__`). On CUDA with graphs this is a launch; on a CPU it is the
  forward itself, whose Python overhead (module calls, dispatch) dominates on a tiny model.
- positions: moving the cache's write position (`SpeculativeCache.advance` / `seek`).
- drafting: the draft round's own work between forwards (argmax, confidence, the cut).
- acceptance + read-back: greedy verification, with the round's one host read.
- plain batches: plain decoding's own work between forwards, with its read-back.
- statistics: the round's statistics and the threshold update.
- prefill: the prompt's forward and first token (`stats.prefill_time_s`), once per call.
- loop: everything else in the call (the round's glue, padding, EOS cuts, the while loop).

Pieces missing from the code under test (an older version) are simply not split out: their time
lands in "loop". Run it on a checkout of another commit to compare (PYTHONPATH=that checkout).

    python benchmarks/host_overhead.py                      # tiny model and the default model, CPU, fp32
    python benchmarks/host_overhead.py --models tiny --repeats 5
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time

import torch

PARTS = {  # part: (module, owner or None, attribute)
    "steps": ("skipsearch.decode.engine", "Step", "__call__"),
    "positions": [("skipsearch.decode.kvcache", "SpeculativeCache", "advance"), ("skipsearch.decode.kvcache", "SpeculativeCache", "seek")],
    "drafting": ("skipsearch.decode.loop", None, "draft_round"),
    "acceptance + read-back": ("skipsearch.decode.loop", None, "verify_greedy"),
    "plain batches": ("skipsearch.decode.loop", None, "_plain_steps"),
    "statistics": ("skipsearch.decode.loop", None, "_record_round"),
}


class ExclusiveTimers:
    """Wraps functions so that each part's time excludes the time spent in other wrapped parts it calls."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.stack: list[list[float]] = []  # per active call: [start, time spent in wrapped children]

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, children = self.stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[part] += elapsed - children
                if self.stack:
                    self.stack[-1][1] += elapsed
        return timed

    def install(self) -> list:
        import importlib

        undo = []
        for part, places in PARTS.items():
            for module_name, owner_name, name in places if isinstance(places, list) else [places]:
                module = importlib.import_module(module_name)
                owner = getattr(module, owner_name) if owner_name else module
                if owner is None or not hasattr(owner, name):
                    continue  # an older version without this piece: its time stays in "loop"
                original = getattr(owner, name)
                setattr(owner, name, self.wrap(part, original))
                undo.append((owner, name, original))
        return undo


def tiny_model(dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False).to(device).eval()


def measure(model, prompt, skip, policy, compile_mode, new_tokens: int, repeats: int) -> dict[str, float]:
    from skipsearch.decode.loop import generate

    run = dict(skip=skip, max_new_tokens=new_tokens, policy=policy, eos_token_id=None)
    if compile_mode:
        run.update(compile=True, compile_mode=compile_mode)
    generate(model, prompt, **run)  # warm: compiles, allocates
    timers = ExclusiveTimers()
    undo = timers.install()
    walls, prefills, tokens, rounds = [], [], 0, 0
    try:
        for _ in range(repeats):
            out = generate(model, prompt, **run)
            walls.append(out.stats.wall_time_s)
            prefills.append(out.stats.prefill_time_s)
            tokens, rounds = tokens + out.stats.new_tokens, rounds + out.stats.rounds
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
    parts = {part: timers.seconds[part] for part in PARTS}
    parts["prefill"] = sum(prefills)
    parts["loop"] = sum(walls) - sum(parts.values())
    return {"wall": sum(walls), "median_call": statistics.median(walls), "tokens": tokens, "rounds": rounds, **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,default",
                        help="tiny (4 layers, hidden 64), default (the embedded model) and/or config .json files "
                             "(random weights), comma-separated (default: %(default)s)")
    parser.add_argument("--modes", default="eager,regional",
                        help="eager and/or compile modes (regional, frozen, default) (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per call (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (default: 3)")
    args = parser.parse_args()

    from skipsearch.decode.policy import DraftPolicy
    from skipsearch.decode.skipset import SkipSet

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; skipsearch from "
          f"{sys.modules['skipsearch'].__file__}")
    print("microseconds per token (per round in brackets) by part; 'steps' holds the forwards themselves")
    header = f"{'model':8} {'mode':9} {'decoding':22} {'us/token':>9} " + " ".join(f"{p[:14]:>15}" for p in
                                                                                  [*PARTS, "prefill", "loop"])
    print(header)
    for model_name in args.models.split(","):
        if model_name == "tiny":
            model = tiny_model(getattr(torch, args.dtype), args.device)
        elif model_name.endswith(".json"):  # a shape: built from its config with random weights
            from skipsearch.io.models import model_from_config

            model = model_from_config(model_name, device=args.device, dtype=args.dtype)
        else:
            from skipsearch.io.models import load_model

            model = load_model(device=args.device, dtype=args.dtype).model
        prompt = list(range(10, 42))
        layers = model.config.num_hidden_layers
        rows = {"plain": (None, DraftPolicy()),
                "spec k=4 fixed": (SkipSet.of([layers // 2], [], layers), DraftPolicy(max_draft_tokens=4, adaptive=False)),
                "spec adaptive (k<=8)": (SkipSet.of([layers // 2], [], layers), DraftPolicy())}
        for mode in args.modes.split(","):
            for name, (skip, policy) in rows.items():
                r = measure(model, prompt, skip, policy, None if mode == "eager" else mode, args.new_tokens,
                            args.repeats)
                cells = " ".join(f"{1e6 * r[p] / r['tokens']:7.1f} [{1e6 * r[p] / r['rounds']:5.0f}]"
                                 for p in [*PARTS, "prefill", "loop"])
                print(f"{model_name.rsplit('/', 1)[-1]:8} {mode:9} {name:22} {1e6 * r['wall'] / r['tokens']:9.1f} {cells}", flush=True)


if __name__ == "__main__":
    main()
