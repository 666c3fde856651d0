"""The forwards the decoding loop runs, eager or compiled, kept per model so that calls and trials reuse them.

For compiled decoding an `Engine` owns one `SpeculativeCache` (reused while calls fit in it,
so compiled graphs see the same buffers), a draft step per skip set and a verify step per
verify width (eager decoding gets a fresh cache of exactly the call's length):
- the draft step is a one-token forward of the draft view of the model (`draft_model`),
- the verify step is a forward of the full model, `width` tokens wide; compiled, the width is
  fixed (max drafts + 1) and short rounds are padded: padded positions write stale slots past
  the query, which the causal mask hides.
Compiled steps use `torch.compile(fullgraph=True, dynamic=False)`: with CUDA graphs
(`mode="reduce-overhead"`) on CUDA, and on a CPU with the weights frozen into the graph and
autotuned C++ GEMMs (`CPU_INDUCTOR_CONFIG`), so a compiled step reads the weights as they were
when it compiled. Inductor keeps the code it generates for the life of the process, and with
frozen weights that code holds a prepacked copy of them: each compiled skip set keeps about a
model's worth of memory (studies therefore compile in inductor's default mode on a CPU, see
`search.Evaluator`). The engine lives on the model (`engine_for`), not in a global.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._inductor.config

from .kvcache import SpeculativeCache
from .skipping import SkipSet, draft_model

CACHE_BLOCK = 256  # capacities round up to this, so calls of similar lengths share one cache and one graph


def _forward(model: torch.nn.Module, cache: SpeculativeCache, ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Logits (tokens kept, vocab) of one forward of `ids` written at the cache's position."""
    positions = (cache.position + torch.arange(ids.shape[1], device=ids.device)).view(1, -1)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=logits_to_keep)
    return out.logits[0]


def _draft_step(model: torch.nn.Module, cache: SpeculativeCache) -> Callable[[torch.Tensor], torch.Tensor]:
    def draft_step(ids: torch.Tensor) -> torch.Tensor:
        return _forward(model, cache, ids, 1)

    return draft_step


def _verify_step(model: torch.nn.Module, cache: SpeculativeCache) -> Callable[[torch.Tensor], torch.Tensor]:
    def verify_step(ids: torch.Tensor) -> torch.Tensor:
        return _forward(model, cache, ids, 0)

    return verify_step


# Batch-1 decoding on a CPU is matrix-vector products over the weights. MKL's, which inductor calls by default,
# stream weights at about a third of the memory bandwidth; inductor's own C++ GEMM template (autotuned against
# MKL; it needs the weights frozen into the graph, and prepacks them) does far better: see BENCHMARKS.md. These are
# inductor config values patched while a step compiles: passed as torch.compile's `options` they do not take effect.
CPU_INDUCTOR_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       # Autotuning prints every GEMM's candidates to stderr; TORCH_LOGS still shows them on request.
                       "autotune_num_choices_displayed": 0}


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    # None: inductor's best for the device: CUDA graphs ("reduce-overhead") on CUDA, frozen weights and
    # autotuned C++ GEMMs (CPU_INDUCTOR_CONFIG) on a CPU. Any torch.compile mode name overrides that.
    mode: str | None = None

    def resolved(self, device: torch.device) -> tuple[str | None, dict]:
        """torch.compile's `mode` for `device`, and the inductor config to patch while compiling."""
        if self.mode is not None or self.backend != "inductor":
            return self.mode, {}
        return ("reduce-overhead", {}) if device.type == "cuda" else (None, dict(CPU_INDUCTOR_CONFIG))


class Step:
    """One forward kind, eager or compiled; the first compiled call's time is its compile time."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 settings: CompileSettings | None):
        self.device = device
        self.mode, self.inductor_config = settings.resolved(device) if settings else (None, {})
        self.fn = fn if settings is None else torch.compile(
            _own_code(fn), backend=settings.backend, mode=self.mode, fullgraph=True, dynamic=False)
        self.compile_time_s: float | None = None if settings else 0.0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mode == "reduce-overhead":
            # CUDA graphs reuse output buffers; each step's outputs are consumed before the next step runs.
            torch.compiler.cudagraph_mark_step_begin()
        if self.compile_time_s is not None:
            return self.fn(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        # The first call compiles; shapes are static and each step has its own code, so no later call recompiles.
        with torch._inductor.config.patch(self.inductor_config):
            out = self.fn(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_time_s = time.perf_counter() - start
        return out


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own.

    Dynamo keeps compiled graphs per code object and fails a fullgraph compile once one code
    object has `recompile_limit` graphs: draft steps of every skip set share `draft_step`'s code,
    so a study would fail at its 9th compiled skip set. With its own code a step holds one graph.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@dataclass
class Engine:
    """Compiled steps and the cache they write, per model; eager calls get a fresh, exactly sized cache instead."""

    model: torch.nn.Module
    cache: SpeculativeCache | None = None
    steps: dict = field(default_factory=dict)

    def prepare(self, length: int, skip: SkipSet | None, settings: CompileSettings | None, verify_width: int
                ) -> tuple[SpeculativeCache, Step | None, Step]:
        """The cache (at least `length` slots), the draft step (None without a skip set) and the verify step
        (compiled for `verify_width` tokens; eager steps take any width)."""
        device = self.model.device
        if settings is None:
            cache = SpeculativeCache(self.model.config, length, device)
            draft = Step(_draft_step(draft_model(self.model, skip), cache), device, None) if skip else None
            return cache, draft, Step(_verify_step(self.model, cache), device, None)
        if self.cache is None or not self.cache.matches(length, self.model.dtype, device):
            # Compiled graphs are specialised to the cache's shape: a capacity in blocks serves many lengths.
            self.cache = SpeculativeCache(self.model.config, -(-length // CACHE_BLOCK) * CACHE_BLOCK, device)
            self.steps.clear()  # they close over the old cache
        draft = self._step(("draft", skip, settings), lambda: _draft_step(draft_model(self.model, skip), self.cache),
                           settings) if skip else None
        verify = self._step(("verify", verify_width, settings), lambda: _verify_step(self.model, self.cache), settings)
        return self.cache, draft, verify

    def _step(self, key: tuple, make: Callable[[], Callable], settings: CompileSettings) -> Step:
        if key not in self.steps:
            self.steps[key] = Step(make(), self.model.device, settings)
        return self.steps[key]


def engine_for(model: torch.nn.Module) -> Engine:
    """The model's engine, made on first use and kept on the model (it lives and dies with it)."""
    engine = model.__dict__.get("_skipsearch_engine")
    if engine is None:
        engine = Engine(model)
        object.__setattr__(model, "_skipsearch_engine", engine)
    return engine
