"""What a new skip set costs a study before its first timed token: setup time and memory (a benchmark script).

For each compile mode, decodes one prompt with each of N distinct skip sets (sparse, seeded, as a
study proposes them) through one engine and prints, per set: the setup time of its new steps
(`stats.compile_time_s`: compiling, capturing), the decode time, the process's memory (RSS on a
CPU; allocated memory on CUDA), and whether the output equals transformers' greedy output. Then
the first set's setup against the median of the later ones, and memory growth per set against
the model's size.

    python benchmarks/skip_set_setup.py                                   # default model, CPU, fp32
    python benchmarks/skip_set_setup.py --modes regional --sets 50        # the study's mode alone
    python benchmarks/skip_set_setup.py --device cuda --dtype bfloat16 --config-only benchmarks/configs/llama-2-7b.json

Modes: "regional" (what studies run: compiled layer kinds shared by every set; CUDA graphs on
CUDA), "default" (the whole step compiled per set in inductor's default mode: what studies ran
before), "frozen" (a CPU's deployment mode: frozen weights, autotuned GEMMs, per set).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import psutil
import torch

from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet


def sparse_sets(num_layers: int, count: int, seed: int = 0, share: float = 0.15) -> list[SkipSet]:
    """Distinct sets skipping about `share` of the sublayers (the study's prior), first and last layers kept."""
    possible = 4 ** max(0, num_layers - 2) - 1  # each inner layer skips its attention, MLP, both or neither
    if count > possible:  # else the draws below never end
        raise ValueError(f"{num_layers} layers have {possible} distinct skip sets that keep the first and last layers, "
                         f"not {count}")
    rng, sets = random.Random(seed), []
    while len(sets) < count:
        inner = range(1, num_layers - 1)
        skip = SkipSet.of([i for i in inner if rng.random() < share], [i for i in inner if rng.random() < share],
                          num_layers)
        if skip.size and skip not in sets:
            sets.append(skip)
    return sets


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_mode(model, prompt: list[int], sets: list[SkipSet], mode: str, n: int, backend: str = "inductor") -> None:
    device, policy = model.device, DraftPolicy(max_draft_tokens=4)
    expected = hf_greedy(model, prompt, n)
    setups, memories = [], []
    print(f"\nmode {mode} ({backend}): set, setup s, decode s, memory MB, identical to HF greedy")
    for i, skip in enumerate(sets):
        start = time.perf_counter()
        out = generate(model, prompt, skip=skip, max_new_tokens=n, policy=policy, eos_token_id=None, compile=True,
                       compile_mode=mode, compile_backend=backend)
        wall = time.perf_counter() - start
        setups.append(out.stats.compile_time_s)
        memories.append(memory_bytes(device))
        print(f"  {i:3d} {str(skip):44} {setups[-1]:8.2f} {wall - setups[-1]:8.2f} {memories[-1] / 2**20:9.0f} "
              f"{out.tokens == expected}", flush=True)
    later = setups[1:]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    growth = (memories[-1] - memories[1]) / max(1, len(memories) - 2)
    print(f"mode {mode} ({backend}): first set's setup {setups[0]:.2f} s; later sets median {statistics.median(later):.3f} s "
          f"(max {max(later):.3f} s), {100 * statistics.median(later) / setups[0]:.1f}% of the first; memory "
          f"{growth / 2**20:+.1f} MB per set after the second ({100 * growth / weights:+.1f}% of the "
          f"{weights / 2**20:.0f} MB of weights)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--config-only", default=None, metavar="CONFIG",
                        help="build the model from this config.json with random weights instead of loading one")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 (default: float32)")
    parser.add_argument("--modes", default="regional,default", help="comma-separated (default: %(default)s)")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend; 'eager' with --modes regional captures CUDA graphs of uncompiled "
                             "layers (default: inductor)")
    parser.add_argument("--sets", type=int, default=12, help="distinct skip sets per mode (default: 12)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per decode (default: 32)")
    args = parser.parse_args()
    if args.sets < 2:
        parser.error("--sets must be at least 2: the later sets' setup is compared with the first's")

    from skipsearch.io import models

    if args.config_only:
        model = models.model_from_config(args.config_only, device=args.device, dtype=args.dtype)
    else:
        model = models.load_model(args.model, device=args.device, dtype=args.dtype).model
    layers = model.config.num_hidden_layers
    prompt = list(range(100, 140))
    print(f"{type(model).__name__}, {layers} layers, {model.device}, {model.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for mode in args.modes.split(","):
        run_mode(model, prompt, sparse_sets(layers, args.sets), mode, args.new_tokens, args.backend)


if __name__ == "__main__":
    main()
