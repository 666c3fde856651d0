"""A step, one forward of the decoding loop at the cache's write position (eager or compiled, on CUDA replayed as a
CUDA graph), the prompt's prefill, and what a call decodes with (`Steps`). The engine (engine.py) makes and keeps
them."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch._inductor.config
from torch import nn

from . import adapter
from .kvcache import SpeculativeCache

# The widths a compiled prefill runs at (`prefill_chunks`), so that no prompt length compiles or captures anything new.
# The widest is at most the engine's CACHE_BLOCK, so a padded chunk never writes past the cache (its capacity is the
# prompt and more, rounded up to CACHE_BLOCK).
PREFILL_WIDTHS = (16, 64, 256)


def prefill_chunks(length: int, widths: tuple[int, ...] = PREFILL_WIDTHS) -> list[tuple[int, int]]:
    """How a prompt of `length` tokens is prefilled: (its tokens, the step's width) per chunk. Each chunk is the
    widest step the rest fills, and the rest under the narrowest width is padded to it: padding stays under the
    narrowest width, because a CPU's prefill is compute-bound (a 109-token prompt padded to one 256-wide step is 2.3x
    the work), and on CUDA a step more is one more graph replay."""
    chunks = []
    while length > 0:
        width = max((w for w in widths if w <= length), default=widths[0])
        chunks.append((min(width, length), width))
        length -= width
    return chunks


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_at_position(model: nn.Module, cache: SpeculativeCache, ids: torch.Tensor,
                        logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """Logits (the last `logits_to_keep` rows, or the rows a tensor of indices names; 0: all, as verification needs)
    of one forward of `ids` (1, width) written at the cache's position, which then moves past them."""
    width = ids.shape[1]
    logits = adapter.model_forward(model, ids, cache.positions(width), cache.attention_mask(width), cache,
                                   logits_to_keep)
    cache.advance(width)
    return logits[0]



class Step:
    """One forward kind, eager or compiled; the first call's time (compiling, capturing) is its setup time.

    With `graph_pool` (CUDA), the first call captures the forward as a CUDA graph and every call
    replays it: the returned logits are a static buffer, valid until the next step runs.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], cache: SpeculativeCache, compiled: bool,
                 inductor_config: dict | None = None, graph_pool: tuple | None = None, tree_graphs: bool = False,
                 prepare: Callable[[], None] | None = None,
                 attention: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.fn, self.cache = fn, cache
        self.attention = attention  # entered around every forward this step runs or compiles (`engine_attention`)
        self.device = cache.position.device
        self.inductor_config = inductor_config or {}
        self.graph_pool, self.graph = graph_pool, None
        # torch.compile's own CUDA graphs (cudagraph trees): each step's outputs are consumed before the next step.
        self.tree_graphs = tree_graphs
        self.prepare = prepare  # work of the first call that belongs to its setup time (compiling the layer kinds)
        self.setup_time_s: float | None = None if compiled else 0.0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.ids.copy_(ids)
            self.graph.replay()
            return self.logits
        with self.attention():
            if self.tree_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            if self.setup_time_s is not None:
                return self.fn(ids)
            return self._set_up(ids)

    def _set_up(self, ids: torch.Tensor) -> torch.Tensor:
        """The first call: compiling, capturing, timed as the step's setup."""
        synchronize(self.device)
        start = time.perf_counter()
        with torch._inductor.config.patch(self.inductor_config), warnings.catch_warnings():
            # Inductor's autotuning on a CPU calls a storage API torch deprecates: nothing for a user of ours to act on.
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            if self.prepare is not None:
                self.prepare()
            out = self._capture(ids) if self.graph_pool is not None else self.fn(ids)
        synchronize(self.device)
        self.setup_time_s = time.perf_counter() - start
        return out

    def _capture(self, ids: torch.Tensor) -> torch.Tensor:
        """Warm up on a side stream (compiling, autotuning), capture one call as a CUDA graph, replay it for this call.
        The warm-ups write stale slots at the position and are rolled back; capturing runs nothing."""
        # Warmed up on the very tensor it captures: a whole compiled step's guards see the input itself.
        position, self.ids = self.cache.position.clone(), ids.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(self.ids)
                self.cache.position.copy_(position)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self.logits = self.fn(self.ids)
        self.graph = graph
        graph.replay()
        return self.logits


class Prefill:
    """The prompt's forward, returning the logits (1, vocab) that predict the first new token.

    Eager (`steps` None): one forward of the whole prompt. Compiled: full-model steps at PREFILL_WIDTHS, in the
    chunks of `prefill_chunks`, the last padded after its tokens; the step keeps only the row of the chunk's
    last real token (`row`, a device tensor its graph reads), and the position moves back over the padding, whose
    slots become stale. Causal attention keeps the padding out of the real tokens' logits. A prompt whose chunks
    would take other rotary frequencies than its one forward (`_chunks_switch`) is prefilled eagerly.
    """

    def __init__(self, model: nn.Module, cache: SpeculativeCache, steps: dict[int, Step] | None = None,
                 row: torch.Tensor | None = None,
                 attention: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.cache, self.steps, self.row, self.attention = model, cache, steps, row, attention
        self.switches = adapter.rope_switches(model.config)

    def _chunks_switch(self, length: int) -> bool:
        """Whether a chunk's forward, its padding counted, and the whole prompt's lie on two sides of a rotary
        embedding's switch (longrope: `adapter.rope_switches`), which decides each forward's frequencies by its
        last position."""
        ends, start = [], 0
        for real, width in prefill_chunks(length):
            ends.append(start + width)
            start += real
        return any((end > switch) != (length > switch) for switch in self.switches for end in ends)

    def __call__(self, prompt: torch.Tensor) -> torch.Tensor:
        if self.steps is None or (self.switches and self._chunks_switch(prompt.shape[1])):
            with self.attention():
                return forward_at_position(self.model, self.cache, prompt, logits_to_keep=1)
        self._set_up(prompt)
        start = 0
        for real, width in prefill_chunks(prompt.shape[1]):
            chunk = prompt[:, start : start + real]
            start += real
            self.row.fill_(real - 1)  # a scalar written on the device: no host sync
            padding = width - real  # only the last chunk's
            logits = self.steps[width](torch.cat([chunk, chunk[:, -1:].expand(1, padding)], dim=1) if padding else chunk)
            if padding:
                self.cache.advance(-padding)
        return logits

    def _set_up(self, prompt: torch.Tensor) -> None:
        """Every width's first call (compiling; capturing on CUDA) at once, in the first prefill's setup time, so that
        no later prompt length sets anything up. They write stale slots at the position, which is then restored."""
        position = self.cache.position.clone()
        for width, step in self.steps.items():
            if step.setup_time_s is None:
                self.row.fill_(0)
                step(prompt[:, :1].expand(1, width))
                self.cache.position.copy_(position)


class Steps(NamedTuple):
    """What a call decodes with: the cache, the draft step (None: plain decoding), the verify step, the plain
    step (the full model on one token: the verify step where it takes any width) and the prefill."""

    cache: SpeculativeCache
    draft: Step | None
    verify: Step
    plain: Step
    prefill: Prefill

    def not_set_up(self) -> list[Step]:
        """The steps whose first call (compiling, capturing) is still to come."""
        steps = [self.draft, self.verify, self.plain, *(self.prefill.steps or {}).values()]
        return [step for step in steps if step is not None and step.setup_time_s is None]
