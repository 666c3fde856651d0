"""The forwards the decoding loop runs, eager or compiled, kept per model so that calls and trials reuse them.

For compiled decoding an `Engine` owns one `SpeculativeCache` (reused while calls fit in it,
so compiled graphs see the same buffers) and, per skip set, a draft step and a verify step
(eager decoding gets a fresh cache of exactly the call's length):
- the draft step is a one-token forward of the draft view of the model (`draft_model`),
- the verify step is a forward of the full model, `width` tokens wide; compiled, the width is
  fixed (max drafts + 1) and short rounds are padded: padded positions write stale slots past
  the query, which the causal mask hides.
Compiled steps use `torch.compile(fullgraph=True, dynamic=False)`, with CUDA graphs
(`mode="reduce-overhead"`) on CUDA. The engine lives on the model (`engine_for`), not in a global.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kvcache import SpeculativeCache
from .skipping import SkipSet, draft_model

CACHE_BLOCK = 256  # capacities round up to this, so calls of similar lengths share one cache and one graph
RECOMPILE_LIMIT = 64  # graphs per step kind: one per skip set and verify width; dynamo's default is 8


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


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str | None = None  # None: "reduce-overhead" (CUDA graphs) for inductor on CUDA, the default elsewhere

    def resolved_mode(self, device: torch.device) -> str | None:
        if self.mode is None and self.backend == "inductor" and device.type == "cuda":
            return "reduce-overhead"
        return self.mode


class Step:
    """One forward kind, eager or compiled; the first compiled call's time is its compile time."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 settings: CompileSettings | None):
        self.device = device
        self.mode = settings.resolved_mode(device) if settings else None
        self.fn = fn if settings is None else torch.compile(
            fn, backend=settings.backend, mode=self.mode, fullgraph=True, dynamic=False)
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
        out = self.fn(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_time_s = time.perf_counter() - start
        return out


@dataclass
class Engine:
    """Compiled steps and the cache they write, per model; eager calls get a fresh, exactly sized cache instead."""

    model: torch.nn.Module
    cache: SpeculativeCache | None = None
    steps: dict = field(default_factory=dict)

    def prepare(self, length: int, skip: SkipSet | None, settings: CompileSettings | None
                ) -> tuple[SpeculativeCache, Step | None, Step]:
        """The cache (at least `length` slots), the draft step (None without a skip set) and the verify step."""
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
        return self.cache, draft, self._step(("verify", settings), lambda: _verify_step(self.model, self.cache),
                                             settings)

    def _step(self, key: tuple, make: Callable[[], Callable], settings: CompileSettings) -> Step:
        if key not in self.steps:
            self.steps[key] = Step(make(), self.model.device, settings)
        return self.steps[key]

    def compile_time_s(self) -> float:
        return sum(step.compile_time_s or 0.0 for step in self.steps.values())


def engine_for(model: torch.nn.Module) -> Engine:
    """The model's engine, made on first use and kept on the model (it lives and dies with it)."""
    engine = model.__dict__.get("_skipsearch_engine")
    if engine is None:
        engine = Engine(model)
        object.__setattr__(model, "_skipsearch_engine", engine)
    return engine
