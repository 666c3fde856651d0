"""One layer's attention over a long cache, kernel by kernel (a benchmark script, not a test).

On an H200 a one-token step's attention read a grouped-query model's cache at 51-203 GB/s, and a model without
grouped queries at the bandwidth (BENCHMARKS.md, "Twenty-second session"). This times the attention alone, without
building or compiling a model, so that one short run answers which way of attending reads a long cache fastest (on
the H200 of 2026-11-28 "gqa", one token 1.2-24x the folded way, now the engine's way there: BENCHMARKS.md,
"Twenty-fifth session"):
- "folded": `decode/attention.py`'s `grouped_sdpa` with `fold=True`: a key/value head's query heads folded into the
  query's rows (the engine's way on CUDA where cuDNN's kernel does not take a grouped query), SDPA's own choice of
  kernel;
- "cudnn", "efficient": the same with SDPA's cuDNN kernel (the H200's own choice, to confirm it) or its
  memory-efficient one;
- "unfolded": each key/value head copied out to its query heads (transformers' `repeat_kv` in a compiled step, the
  copy timed too), then SDPA: more heads to spread over, the copy's bytes on top;
- "math": the folded attention through SDPA's math backend, in eager kernels (inductor fuses them in a compiled
  step); in bf16 it computes in fp32 (torch's default), so it moves more bytes than the cache's;
- "gqa", "gqa-cudnn": neither folded nor copied: SDPA's own grouped-query attention (`enable_gqa`, the engine's way
  on a CPU and on Hopper GPUs in fp16 and bf16, `grouped_sdpa`'s `fold=False`), by SDPA's choice of kernel and with
  cuDNN's forced: of SDPA's CUDA kernels only cuDNN's takes a grouped query with a mask (in fp16 and bf16); where
  SDPA picks its math kernel instead, that one repeats the keys, and "gqa" is slower than "gqa-cudnn".
Each is timed at the cache's last slots (every slot attended), for the shapes' key/value heads and head size, one
token and a verification's width, paired and interleaved with "folded": folded over the method, with its 95%
interval (above 1: the method is faster), each one's milliseconds a call and the GB/s of keys and values it read,
and its largest difference from folded's output relative to that output's largest value. On CUDA each method runs
as a CUDA graph of its calls (no host time, as the engine's steps), and the calls cycle through `--ring-mb` of
copies of the cache, so that none reads one still in the L2 cache (a real step's cache never is); on a CPU as
calls. A row the engine's own way fails on is one line, and the next row runs.

    python benchmarks/attention_kernels.py --device cuda --dtype bfloat16 \\
        --shapes qwen2.5-1.5b,smollm2-135m,llama-3-8b,llama-2-7b --slots 256,4096,16384
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from skipsearch.decode.attention import grouped_sdpa
from skipsearch.decode.kvcache import cache_bytes, kv_shape
from skipsearch.io.models import load_config

from verify_head import _x, pair

CONFIGS = Path(__file__).resolve().parent / "configs"


def folded(module, q, k, v, mask, backends=None, fold=True):
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return grouped_sdpa(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5, fold=fold)[0]


def unfolded(module, q, k, v, mask):
    batch, heads, slots, dim = k.shape
    groups = module.num_key_value_groups
    k, v = (t[:, :, None].expand(batch, heads, groups, slots, dim).reshape(batch, heads * groups, slots, dim)
            for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


METHODS: dict[str, Callable] = {
    "cudnn": lambda *args: folded(*args, backends=[SDPBackend.CUDNN_ATTENTION]),
    "unfolded": unfolded,
    "efficient": lambda *args: folded(*args, backends=[SDPBackend.EFFICIENT_ATTENTION]),
    "math": lambda *args: folded(*args, backends=[SDPBackend.MATH]),
    "gqa": lambda *args: folded(*args, fold=False),
    "gqa-cudnn": lambda *args: folded(*args, backends=[SDPBackend.CUDNN_ATTENTION], fold=False),
}


def inputs(config, slots: int, width: int, device: torch.device, dtype: torch.dtype, copies: int):
    """A layer's attention module stand-in, its query, `copies` caches of keys and values, and the mask of a step
    at the cache's last slots (every slot attended)."""
    heads, (kv_heads, dim) = config.num_attention_heads, kv_shape(config)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q = torch.randn(1, heads, width, dim, device=device, dtype=dtype)
    caches = [tuple(torch.randn(1, kv_heads, slots, dim, device=device, dtype=dtype) for _ in range(2))
              for _ in range(copies)]
    rows = torch.arange(slots - width, slots, device=device)[:, None]
    allowed = torch.arange(slots, device=device)[None, :] <= rows
    mask = torch.zeros(1, 1, width, slots, device=device, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return module, q, caches, mask


def runner(calls: list[Callable[[], torch.Tensor]], device: torch.device) -> Callable[[], None]:
    """The calls run in order: on CUDA as one replay of a CUDA graph of them (warmed first, and replayed once
    untimed, so that no timing holds the graph's upload), else one by one."""
    if device.type != "cuda":
        return lambda: [call() for call in calls]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    replay()
    return replay


def measure(name: str, config, slots: int, width: int, args) -> None:
    """One row: folded's time and read rate, then each method's, paired with folded, and its largest difference
    from folded's output relative to that output's largest value."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer_bytes = cache_bytes(config, slots, dtype) // config.num_hidden_layers  # one layer's keys and values
    copies = max(1, math.ceil(args.ring_mb * 1e6 / layer_bytes))  # each call reads a cache the last did not
    module, q, caches, mask = inputs(config, slots, width, device, dtype, copies)
    calls = max(args.calls, copies)

    def thunks(fn):
        return [lambda k=caches[i % copies][0], v=caches[i % copies][1]: fn(module, q, k, v, mask)
                for i in range(calls)]
    reference = folded(module, q, *caches[0], mask).float()
    base, base_s, cells = runner(thunks(folded), device), [], []
    for method, fn in METHODS.items():
        try:
            difference = float((fn(module, q, *caches[0], mask).float() - reference).abs().max())
            ratio, folded_s, method_s = pair(base, runner(thunks(fn), device), args.repeats)
        except RuntimeError as error:  # a kernel this device or dtype lacks: said in one line, the rest measured
            cells.append(f"{method} FAILED ({(str(error) or type(error).__name__).splitlines()[0][:60]})")
            continue
        base_s.append(folded_s)
        ms = method_s / calls * 1e3
        cells.append(f"{method} {ms:.3f} ms {layer_bytes / 1e6 / ms:.0f} GB/s {_x(ratio)} "
                     f"(max diff {difference / float(reference.abs().max()):.2g})")
    if not base_s:  # every method failed: folded's time alone
        base_s.append(pair(base, base, args.repeats)[1])
    ms = statistics.median(base_s) / calls * 1e3
    print(f"{name} {slots} slots {width} token(s): folded {ms:.3f} ms {layer_bytes / 1e6 / ms:.0f} GB/s; "
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
    parser.add_argument("--ring-mb", type=float, default=None,
                        help="MB of caches the calls of a timing cycle through, so that none reads a cache still in "
                             "the GPU's L2 (about 50 MB on an H200) as a real step never does (default: 150 on "
                             "CUDA, 0 elsewhere)")
    args = parser.parse_args()
    if args.ring_mb is None:
        args.ring_mb = 150.0 if args.device.startswith("cuda") else 0.0
    print(f"one layer's attention on {args.device} ({args.dtype}); folded over each method, 95% interval; "
          f"calls cycle through {args.ring_mb:g} MB of caches")
    for name in args.shapes.split(","):
        config = load_config(str(CONFIGS / f"{name}.json"))
        for slots in (int(s) for s in args.slots.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                try:
                    measure(name, config, slots, width, args)
                except RuntimeError as error:  # the engine's own way failed here: one line, the next row measured
                    print(f"{name} {slots} slots {width} token(s): FAILED, {type(error).__name__}: "
                          f"{(str(error) or '-').splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
