"""One layer's attention over a long cache, kernel by kernel (a benchmark script, not a test).

On an H200 a one-token step's attention read a grouped-query model's cache at 51-203 GB/s, and a model without
grouped queries at the bandwidth (BENCHMARKS.md, "Twenty-second session"). This times the attention alone, without
building or compiling a model, so that one short run answers which way of attending reads a long cache fastest:
- "folded": the engine's (`decode/attention.py`'s `grouped_sdpa`): a key/value head's query heads folded into the
  query's rows, SDPA's own choice of kernel (cuDNN's on the H200);
- "unfolded": each key/value head copied out to its query heads (transformers' `repeat_kv`, the copy timed too),
  then SDPA: more heads to spread over, the copy's bytes on top;
- "efficient" and "math": the folded attention with SDPA's memory-efficient kernel, or its math backend (matrix
  products and a softmax, in eager kernels here; inductor fuses them in a compiled step).
Each is timed at the cache's last slots (every slot attended), for the shapes' key/value heads and head size, one
token and a verification's width, paired and interleaved with "folded": folded over the method, with its 95%
interval (above 1: the method is faster), each one's milliseconds and the GB/s of keys and values it read, and its
largest difference from "folded". On CUDA each method runs as a CUDA graph of `--calls` calls (no host time, as the
engine's steps), on a CPU as calls.

    python benchmarks/attention_kernels.py --device cuda --dtype bfloat16 \\
        --shapes qwen2.5-1.5b,llama-3-8b,llama-2-7b --slots 256,4096,16384
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from skipsearch.decode.attention import grouped_sdpa

from verify_head import _x, pair

CONFIGS = Path(__file__).resolve().parent / "configs"


def folded(module, q, k, v, mask, backends=None):
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return grouped_sdpa(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


def unfolded(module, q, k, v, mask):
    batch, heads, slots, dim = k.shape
    groups = module.num_key_value_groups
    k, v = (t[:, :, None].expand(batch, heads, groups, slots, dim).reshape(batch, heads * groups, slots, dim)
            for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


METHODS: dict[str, Callable] = {
    "unfolded": unfolded,
    "efficient": lambda *args: folded(*args, backends=[SDPBackend.EFFICIENT_ATTENTION]),
    "math": lambda *args: folded(*args, backends=[SDPBackend.MATH]),
}


def inputs(config: dict, slots: int, width: int, device: torch.device, dtype: torch.dtype):
    """A layer's attention module stand-in, query, cache keys and values, and the mask of a step at the last slots."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    dim = config.get("head_dim") or config["hidden_size"] // heads
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q = torch.randn(1, heads, width, dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, slots, dim, device=device, dtype=dtype) for _ in range(2))
    rows = torch.arange(slots - width, slots, device=device)[:, None]
    allowed = torch.arange(slots, device=device)[None, :] <= rows
    mask = torch.zeros(1, 1, width, slots, device=device, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return module, q, k, v, mask


def runner(fn: Callable[[], torch.Tensor], device: torch.device, calls: int) -> Callable[[], None]:
    """`fn` run `calls` times: on CUDA as one replay of a CUDA graph of them (warmed first), else as calls."""
    if device.type != "cuda":
        return lambda: [fn() for _ in range(calls)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return replay


def measure(name: str, config: dict, slots: int, width: int, args) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    module, q, k, v, mask = inputs(config, slots, width, device, dtype)
    read_gb = 2 * k.numel() * k.element_size() / 1e9
    reference = folded(module, q, k, v, mask).float()
    base = runner(lambda: folded(module, q, k, v, mask), device, args.calls)
    cells, base_s = [], None
    for method, fn in METHODS.items():
        try:
            difference = float((fn(module, q, k, v, mask).float() - reference).abs().max())
            ratio, base_s, method_s = pair(base, runner(lambda: fn(module, q, k, v, mask), device, args.calls),
                                           args.repeats)
        except RuntimeError as error:  # a kernel this device or dtype lacks: said in one line, the rest measured
            cells.append(f"{method} FAILED ({str(error).splitlines()[0][:60]})")
            continue
        ms = method_s / args.calls * 1e3
        cells.append(f"{method} {ms:.3f} ms {read_gb / (ms / 1e3):.0f} GB/s {_x(ratio)} (max diff {difference:.2g})")
    if base_s is None:  # every method failed: folded's time alone
        _, base_s, _ = pair(base, base, args.repeats)
    ms = base_s / args.calls * 1e3
    print(f"{name} {slots} slots {width} token(s): folded {ms:.3f} ms {read_gb / (ms / 1e3):.0f} GB/s; "
          + "; ".join(cells), flush=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,smollm2-135m,llama-3-8b,llama-2-7b",
                        help="configs in benchmarks/configs/ (default: %(default)s)")
    parser.add_argument("--slots", default="256,4096,16384", help="cache sizes (default: %(default)s)")
    parser.add_argument("--widths", default="1,9", help="query tokens: one, a verification's (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=20, help="calls a timing (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=15, help="paired timings (default: %(default)s)")
    args = parser.parse_args()
    print(f"one layer's attention on {args.device} ({args.dtype}); folded over each method, 95% interval")
    for name in args.shapes.split(","):
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        for slots in (int(s) for s in args.slots.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                measure(name, config, slots, width, args)


if __name__ == "__main__":
    main()
