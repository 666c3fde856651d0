"""The engine's compiled steps against variants of how they compile (a benchmark script, not a test).

On CUDA a small model's step is bound by its number of kernels (BENCHMARKS.md, "Seventeenth session"). Each variant
here is a way to launch fewer:
- "frozen": the whole step compiled with the weights frozen into it (the engine's "frozen" mode, a CPU's default),
  captured as a CUDA graph as the regional steps are: inductor then concatenates the linears of one input (a layer's
  query, key and value projections; its gate and up projections), 4 GEMMs a layer instead of 7 (on a CPU: 9 launches a
  layer against the regional steps' 15, BENCHMARKS.md, "Fifteenth session"), for a copy of those weights per step
  that inductor never frees, and a compile per skip set;
- "math": SDPA's math backend alone, as gpt-fast decodes ("better for Inductor to codegen attention here", its
  generate.py), so that inductor writes the attention into kernels of its own; the shipped steps call SDPA's fused
  kernel (cuDNN's on the H200 of 2026-11-27, beside a Memset and the mask's preparation each layer);
- "frozen+math": both;
- "whole": the whole step compiled as one graph (`compile_mode="reduce-overhead"`, CUDA graphs through torch.compile's
  own trees), where a layer's last residual add can fuse with the next layer's norm, at the price of a compile per
  skip set;
- "combo": inductor's combo kernels, which launch independent pointwise kernels as one (CUDA's Triton code only);
- "math+combo": both;
- "efficient" (named, not run by default): SDPA's memory-efficient kernel alone instead of its own choice (cuDNN's on
  the H200), each kernel splitting the work its own way (on the H200 of 2026-11-28 0.55-0.95x the shipped steps:
  BENCHMARKS.md, "Twenty-fifth session");
- "unfolded" (named, not run by default): transformers' own SDPA attention, which copies each key/value head out to
  its query heads, instead of the engine's (`decode/attention.py`), which neither copies nor folds them on a CPU and
  on Hopper GPUs in fp16 and bf16, and elsewhere folds the query heads into the query's rows (a model without grouped
  queries folds nothing: the same steps there);
- "gqa" (named, not run by default): the engine's attention with the query heads neither folded nor copied, given to
  SDPA's own grouped-query attention (`grouped_sdpa`'s `fold=False`), by SDPA's choice of kernel: on CUDA only
  cuDNN's takes it with a mask (in fp16 and bf16), and the math kernel SDPA falls back to repeats the keys;
  "gqa-cudnn" forces cuDNN's (`attention_kernels.py` times both for one layer). The shipped steps' way on a CPU and,
  since the H200 of 2026-11-28 measured it 1.71x as fast on a 4,096-slot cache (BENCHMARKS.md, "Twenty-fifth
  session"), on Hopper GPUs in fp16 and bf16: there it is the shipped step;
- "folded" (named, not run by default): the engine's attention with the query heads always folded
  (`grouped_sdpa`'s `fold=True`), the shipped steps' way on CUDA until that lease, against which "shipped" on a GPU
  now measures the change;
- "unfused" (named, not run by default): the regional steps without their linears of one input fused (a layer's
  query, key and value projections as three GEMMs, its gate and up projections as two: decode/fused.py), the shipped
  steps' way until the twenty-sixth session;
- "unguarded" (named, not run by default): the shipped steps with dynamo's guards left unchecked
  (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), what the guards cost a regional step on a CPU, where
  each layer's compiled function checks its guards at every call (on CUDA the steps replay as CUDA graphs and check
  none). Not for the engine: a call that needed another graph would run the one it has;
- "cpp" (named, not run by default): inductor's C++ wrapper (`cpp_wrapper`): each compiled graph's host code, which
  calls its kernels, made C++ instead of Python.
Variants run in this order by default, the likeliest to cut most first: a call cut at its limit keeps those, and a
variant that fails is reported in one line and the next one runs.
Each variant is a copy of the model whose steps are compiled (and on CUDA captured: a CUDA graph keeps what it was
captured with) under it. Per cache size, each step's kernels (CUDA) or operators (CPU) are counted, each variant's
logits are checked against the shipped step's for the same input (`agreement`: the rows whose top-1 token is the
same, the largest difference, and the shipped rows' smallest top-1 lead), and each variant's step is timed paired and
interleaved with the shipped one, writing the cache's last slots: shipped over variant, with its 95% interval (above
1: the variant is faster).

    python benchmarks/step_variants.py --device cuda --dtype bfloat16 \
        --config-only benchmarks/configs/smollm2-135m.json --slots 256,1024
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch._functorch.config
import torch._inductor.config
from torch.nn.attention import SDPBackend, sdpa_kernel

from skipsearch.decode import adapter
from skipsearch.decode.attention import grouped_sdpa
from skipsearch.decode.engine import CompileSettings, engine_for

from cache_resize import SETTINGS, prepared
from decode_speed import add_model_arguments, load_for_benchmark
from kernel_count import count_kernels, profile_inductor_cpu_kernels
from verify_head import pair


class Variant(NamedTuple):
    backends: list[SDPBackend] | None = None  # SDPA's backends; None: its own choice
    attention: Callable | None = None  # what the engine's attention name runs; None: the engine's own (grouped_sdpa)
    inductor: dict = {}  # inductor settings patched while the steps compile
    settings: CompileSettings = SETTINGS  # the engine's: regional steps unless named
    unguarded: bool = False  # run with dynamo's guards unchecked
    fused: bool = True  # the regional steps' linears of one input fused (decode/fused.py)


FROZEN = CompileSettings(mode="frozen")
VARIANTS = {"shipped": Variant(), "frozen": Variant(settings=FROZEN), "math": Variant(backends=[SDPBackend.MATH]),
            "frozen+math": Variant(backends=[SDPBackend.MATH], settings=FROZEN),
            "combo": Variant(inductor={"combo_kernels": True}),
            "math+combo": Variant(backends=[SDPBackend.MATH], inductor={"combo_kernels": True}),
            "whole": Variant(settings=CompileSettings(mode="reduce-overhead")), "unguarded": Variant(unguarded=True),
            "unfused": Variant(fused=False), "cpp": Variant(inductor={"cpp_wrapper": True}),
            "efficient": Variant(backends=[SDPBackend.EFFICIENT_ATTENTION]),
            "unfolded": Variant(attention=adapter.sdpa_attention),
            "gqa": Variant(attention=functools.partial(grouped_sdpa, fold=False)),
            "folded": Variant(attention=functools.partial(grouped_sdpa, fold=True)),
            "gqa-cudnn": Variant(backends=[SDPBackend.CUDNN_ATTENTION],
                                 attention=functools.partial(grouped_sdpa, fold=False))}


@contextlib.contextmanager
def engine_attention_running(function: Callable | None):
    """Inside: the engine's steps attend through `function` (None: through the engine's own attention)."""
    if function is None:
        yield
        return
    adapter.register_attention(adapter.ENGINE_ATTENTION, function)
    try:
        yield
    finally:
        adapter.register_attention(adapter.ENGINE_ATTENTION, grouped_sdpa)


@contextlib.contextmanager
def compiled_as(variant: str):
    """Inside: steps compile (and SDPA runs) as `variant` has them. A variant compiles without the compile caches:
    their keys leave out SDPA's backends, so a variant's graphs would come back as the shipped ones."""
    spec = VARIANTS[variant]
    uncached = {} if variant == "shipped" else {"fx_graph_cache": False}
    with (sdpa_kernel(spec.backends) if spec.backends else contextlib.nullcontext(),
          engine_attention_running(spec.attention),
          torch._inductor.config.patch({**spec.inductor, **uncached}),
          torch._functorch.config.patch(enable_autograd_cache=variant == "shipped")):
        yield


def under(variant: str, call):
    """`call` run as `variant`. The shipped steps enter their (empty) contexts too, so that both sides of a pair pay
    about the same host work for them."""
    unguarded = VARIANTS[variant].unguarded  # once compiled: torch refuses to compile under this stance

    def run():
        with (compiled_as(variant),
              torch.compiler.set_stance(skip_guard_eval_unsafe=True) if unguarded else contextlib.nullcontext()):
            return call()
    return run


def agreement(shipped, variant) -> str:
    """How the variant step's logits compare with the shipped step's for the same input: rows whose top-1 token is the
    same, the largest difference, and the shipped rows' smallest lead of their top token over the next (random weights
    give near ties, which rounding alone can flip: a row can differ only where the difference reaches its lead). Both
    are read at once: a CUDA graph's output is overwritten by its next replay."""
    expected = shipped().float().clone()
    got = variant().float()
    same = int((expected.argmax(-1) == got.argmax(-1)).sum())
    top = expected.topk(2, dim=-1).values
    return (f"top-1 same in {same}/{expected.shape[0]} rows, max difference {float((expected - got).abs().max()):.2g}"
            f" (smallest top-1 lead {float((top[:, 0] - top[:, 1]).min()):.2g})")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--variants", default="frozen,math,frozen+math,whole,combo,math+combo",
                        help=f"compared with the shipped steps, of {', '.join(list(VARIANTS)[1:])} (default: %(default)s)")
    parser.add_argument("--slots", default="256,1024", help="cache sizes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=5, help="a verify step's tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="paired timings of each step (default: %(default)s)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "shipped" in variants:
        parser.error("--variants: the shipped steps are always measured; name the others")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    profile_inductor_cpu_kernels()  # on a CPU, a count with the compiled graphs' own kernels (timings pay for it)
    model, name, _ = load_for_benchmark(args)
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), {torch.get_num_threads()} threads, "
          f"the shipped (regional) steps against {', '.join(variants)}")
    copies = {"shipped": model} | {variant: copy.deepcopy(model) for variant in variants}
    for slots in (int(s) for s in args.slots.split(",")):
        shipped = compiled_steps(copies["shipped"], "shipped", slots, args.width)
        for step, call in shipped.items():
            print(f"  {step:24} shipped {count_kernels(call, model.device, top=0)[0]} launches", flush=True)
        for variant in variants:  # each measured as soon as it is compiled
            try:
                measure(copies[variant], variant, shipped, slots, args)
            except Exception as error:  # a variant that fails (to compile, to capture) leaves the others measured
                print(f"{slots} slots, {variant}: FAILED, {type(error).__name__}: {str(error).splitlines()[0]}",
                      flush=True)


def measure(model, variant: str, shipped: dict, slots: int, args) -> None:
    """Print `variant`'s launches, agreement and paired time against the `shipped` steps, step by step."""
    for step, call in compiled_steps(model, variant, slots, args.width).items():
        launches = count_kernels(call, model.device, top=0)[0]
        same = agreement(shipped[step], call)
        interval, shipped_s, variant_s = pair(shipped[step], call, args.repeats)
        print(f"  {step:24} {variant:12} {launches:5d} launches  {1e3 * variant_s:7.2f} ms against "
              f"{1e3 * shipped_s:7.2f} ms  shipped over {variant} {interval.estimate:.2f}x "
              f"({interval.low:.2f}-{interval.high:.2f}); {same}", flush=True)


def compiled_steps(model, variant: str, slots: int, width: int) -> dict:
    """The one-token and verify steps of `model`'s engine at `slots`, compiled and run as `variant`, each called twice
    more: torch.compile's own CUDA graphs (the whole step's) warm up on a first call, record on the second and replay
    from the third (the engine's regional steps capture on their first), and a count must see a replay."""
    engine_for(model).fuse_projections = VARIANTS[variant].fused
    with compiled_as(variant):
        steps, graphs, seconds, capacity = prepared(model, slots, width, VARIANTS[variant].settings)
        for call in [*steps.values()] * 2:
            call()
    print(f"{capacity} slots, {variant}: {graphs} new graphs, {seconds:.1f} s", flush=True)
    return {step: under(variant, call) for step, call in steps.items()}


if __name__ == "__main__":
    main()
