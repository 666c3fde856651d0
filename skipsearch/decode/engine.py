"""The forwards the decoding loop runs ("steps"), eager or compiled, kept per model so that calls and trials reuse them.

A step is one forward at the cache's write position that advances the position past what it wrote:
the plain step (one token, full model), the draft step (one token, the draft path of a skip set)
and the verify step (the full model over a round's tokens). How steps run (`CompileSettings`):
- eager (no compile): the model's own forward on a fresh cache of exactly the call's length (on a CPU in float32,
  verification's head packed for oneDNN: packed.py).
- "regional" (CUDA's default, and what studies run on a CPU): every decoder layer runs through a compiled function
  (regional.py) for its kind (its class and attention kind, and which of its sublayers the draft skips) and width,
  shared by all layers and all skip sets (`CompiledLayers`), so a new skip set compiles nothing, and kept when the
  cache is replaced by a longer one (recompiled once with the length dynamic, then reused for every length); with
  inductor, a layer's linears of one input fused (fused.py). On CUDA each step is then captured once as a CUDA graph
  over static buffers and replayed: one launch per step, milliseconds to set up a new skip set.
- "frozen" (a CPU's default for `generate` and `bench`): the whole step compiled with the weights
  frozen into the graph and inductor's autotuned C++ GEMMs (`CPU_INDUCTOR_CONFIG`), the fastest on a
  CPU; a compile per skip set, and inductor keeps each one's prepacked weights for the process's life.
  On CUDA (asked for, not the default) the step is captured as a CUDA graph like a regional one, for a copy of the
  weights per compiled step that inductor there too never frees.
- any torch.compile mode name: the whole step compiled in that mode, one compile per skip set.
Compiled steps share one cache (reused while calls fit in it: graphs see the same buffers) and
the engine keeps the draft steps of the `DRAFT_STEPS_KEPT` latest skip sets, so a study's memory
(regional steps) stays flat. The engine lives on the model (`engine_for`), not in a global.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._inductor.config
from torch import nn
from torch.nn.modules import module as torch_module

from . import adapter
from .adapter import decoder_layers
from .attention import engine_attention
from .kvcache import SpeculativeCache
from .packed import packed_head
from .regional import CompiledLayers, own_code, regional_view
# DRAFT_STEPS_KEPT: skip sets whose draft steps stay ready by default (Engine.kept_skip_sets); older ones are freed
from .skipping import (DRAFT_STEPS_KEPT, draft_model, forget_draft, forget_drafts, head_source, keep_drafts,
                       model_with_head)
from .skipset import SkipSet
from .steps import PREFILL_WIDTHS, Prefill, Step, Steps, forward_at_position

CACHE_BLOCK = 256  # capacities round up to this, so calls of similar lengths share one cache and one graph
# Where the regional modes prefill through compiled widths (steps.PREFILL_WIDTHS): on CUDA, where each width is one
# CUDA graph. On a CPU the compiled chunks lost to one eager forward of the prompt, 0.55x (BENCHMARKS.md, "The compiled
# prefill"), so a CPU prefills eagerly; tests and benchmarks/prefill.py add "cpu" to run the compiled prefill there.
COMPILED_PREFILL_DEVICES = frozenset({"cuda"})


# Batch-1 decoding on a CPU is matrix-vector products over the weights. MKL's, which inductor calls by default, stream
# weights at about a third of the memory bandwidth; inductor's own C++ GEMM template (autotuned against MKL; it needs
# the weights frozen into the graph, and prepacks them) does far better: see BENCHMARKS.md. Patched while a step
# compiles: passed as torch.compile's `options` they do not take effect. The linears of one input are concatenated,
# one GEMM each (`cpp.enable_concat_linear`, frozen graphs only): 4 GEMMs a layer instead of 7, in the memory the
# frozen copies of the weights took already (BENCHMARKS.md, "Fifteenth session").
CPU_INDUCTOR_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       "cpp.enable_concat_linear": True,
                       # Autotuning prints every GEMM's candidates to stderr, and (in recent releases) a line of stats
                       # about them: neither is for a user of `generate` or `bench`. TORCH_LOGS still shows them.
                       "autotune_num_choices_displayed": 0,
                       **({"max_autotune_report_choices_stats": False}
                          if hasattr(torch._inductor.config, "max_autotune_report_choices_stats") else {})}


def frozen_inductor_config(device: torch.device) -> dict:
    """What inductor compiles frozen steps with: `CPU_INDUCTOR_CONFIG` on a CPU; elsewhere freezing alone, whose
    concatenation of the linears of one input is on by default there (its GEMMs are cuBLAS's either way)."""
    return CPU_INDUCTOR_CONFIG if device.type == "cpu" else {"freezing": True}


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    # None: the device's best: "regional" on CUDA (CUDA graphs), "frozen" on a CPU with inductor. See the module doc.
    mode: str | None = None

    def resolved(self, device: torch.device) -> str:
        if self.mode is not None:
            return self.mode
        return "frozen" if device.type == "cpu" and self.backend == "inductor" else "regional"



def model_state(model: nn.Module) -> tuple[tuple, tuple]:
    """What compiled steps bake in and a later call could not otherwise see change: (every module, in order, and every
    parameter's and buffer's address: CUDA graphs and frozen graphs read those), and the forward hooks (dynamo guards
    on none: hooks added after a compile were not run). Taken when steps are made, compared once a call (`_fit_cache`):
    a module replaced (a new LM head, norm or layer), weights put in new memory (`load_state_dict(assign=True)`,
    `resize_token_embeddings`) or hooks changed make the steps again."""
    modules = tuple(model.modules())
    addresses = tuple(tensor.data_ptr() for module in modules
                      for tensor in (*module._parameters.values(), *module._buffers.values()) if tensor is not None)
    hooks = tuple((i, tuple(module._forward_hooks), tuple(module._forward_pre_hooks), module.__dict__.get("forward"))
                  for i, module in enumerate(modules)
                  if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)
    return ((modules, addresses),
            (hooks, tuple(torch_module._global_forward_hooks), tuple(torch_module._global_forward_pre_hooks)))


class Engine:
    """Compiled steps and the cache they write, per model; eager calls get a fresh, exactly sized cache instead.
    What drafting learns across calls is not kept here but in the caller's `controller.DraftMemory`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: SpeculativeCache | None = None
        self.verify_steps: dict[tuple, Step] = {}
        self.draft_steps: collections.OrderedDict[tuple, Step] = collections.OrderedDict()
        self.draft_sources: dict[tuple, tuple] = {}  # the LM head each draft step's trimmed head copied (head_source)
        self.prefill_steps: dict[tuple[int, CompileSettings], Step] = {}
        self.prefill_row: torch.Tensor | None = None  # the row a compiled prefill step keeps (Prefill)
        self.layers: dict[str, CompiledLayers] = {}  # by backend
        self.graph_pool = None
        self.verifier: nn.Module | None = None  # the eager verify step's model (`eager_verifier`)
        self.verifier_source: tuple | None = None  # the head it copied (`head_source`)
        self.attention = engine_attention(model)  # every step's attention function (attention.py)
        self.state: tuple | None = None  # `model_state` when the steps were last made
        self._state_due = False  # steps were made since `state` was taken
        self._kept_skip_sets = DRAFT_STEPS_KEPT
        self.call_sets: set[SkipSet] = set()  # the skip sets the current call made steps for: none evicts another
        keep_drafts(model, self._kept_skip_sets, self.call_sets)  # the eager draft paths: the same bound
        self.fuse_projections = True  # inductor's regional steps fuse linears of one input (fused.py); set it first
        self._lock, self._holder = threading.Lock(), None  # `exclusive`

    # Neither copied nor saved with its model: a deep copy ran the copy through the original's steps and cache (wrong
    # tokens), and torch.save failed on the steps. A copy makes an engine of its own; a saved model loads without one.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return type(None), ()

    @contextlib.contextmanager
    def exclusive(self):
        """Held while a call decodes through the engine's cache (compiled steps), or a profile times or swaps the
        model's layers: one cache, one writer. Another thread's call waits for it (two threads decoding one model at
        once each read the other's keys and values: wrong tokens, on a CPU every time); a call nested in the holder's
        own thread, which would wait forever, is refused with a RuntimeError. A hook that waits for another thread's
        compiled decode of the same model waits forever too."""
        if self._holder == threading.get_ident():
            raise RuntimeError("this model's compiled steps are in use in this thread already (a decode or a profile: "
                               "a hook that decodes?), and a call within it would overwrite their cache: decode "
                               "within it with compile=False, or a copy of the model (copy.deepcopy)")
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield self
            finally:
                self._holder = None

    @property
    def kept_skip_sets(self) -> int:
        """How many skip sets keep their compiled draft steps (and, on CUDA, their captured graphs), least recently
        used first out: the bound on what the engine holds beyond the model and its cache. Settable. (Steps in the
        frozen mode leave inductor their frozen copies of the weights for the process's life: no bound holds them.)"""
        return self._kept_skip_sets

    @kept_skip_sets.setter
    def kept_skip_sets(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"kept_skip_sets must be a whole number >= 1, got {count!r}")
        self._kept_skip_sets = count
        self._evict()
        keep_drafts(self.model, count, self.call_sets)

    @property
    def steps(self) -> dict[tuple, Step]:
        """Every step kept: ("verify", width, settings) and ("draft", skip set, settings)."""
        return {**{("verify", *key): step for key, step in self.verify_steps.items()},
                **{("draft", *key): step for key, step in self.draft_steps.items()}}

    def prepare(self, length: int, skip: SkipSet | None, settings: CompileSettings | None, verify_width: int
                ) -> Steps:
        """The cache (at least `length` slots) and the steps writing it (`steps_for`)."""
        return self.steps_for(self.cache_for(length, settings), skip, settings, verify_width)

    def cache_for(self, length: int, settings: CompileSettings | None) -> SpeculativeCache:
        """A cache of at least `length` slots: a fresh one of exactly that size for eager steps; for compiled steps
        the engine's own, whose buffers their graphs read (replaced, and the steps with it, when too small)."""
        self.call_sets.clear()  # a new call: its sets are those it asks steps for next
        if settings is None:
            return SpeculativeCache(self.model.config, length, self.model.device, self.model.dtype)
        self._fit_cache(length)
        return self.cache

    def steps_for(self, cache: SpeculativeCache, skip: SkipSet | None, settings: CompileSettings | None,
                  verify_width: int) -> Steps:
        """The steps writing `cache`, as `cache_for` gave it: the draft step (None without a skip set), the verify step
        (compiled for `verify_width` tokens; eager steps take any width) and the plain step. Compiled steps compile on
        their first call, so a plain step that is never called costs nothing. The preparation is split from the
        cache's so that a caller can prefill the cache before it knows which skip set to draft with (choice.py)."""
        if skip:
            self.call_sets.add(skip)
        if settings is None:
            draft = Step(_step(draft_model(self.model, skip), cache), cache, compiled=False,
                         attention=self.attention) if skip else None
            full = Step(_step(self.model, cache), cache, compiled=False, attention=self.attention)
            verify = Step(_step(self.eager_verifier(), cache), cache, compiled=False, attention=self.attention)
            return Steps(cache, draft, verify, full, Prefill(self.model, cache, attention=self.attention))
        if cache is not self.cache:
            raise ValueError("compiled steps write the engine's own cache: get it from cache_for")
        for width in {verify_width, 1}:
            if (width, settings) not in self.verify_steps:
                self.verify_steps[width, settings] = self._compiled_step(None, settings)
        steps = Steps(cache, self._draft_step(skip, settings) if skip else None,
                      self.verify_steps[verify_width, settings], self.verify_steps[1, settings],
                      self._prefill(settings))
        if self._state_due:  # after the steps are made: making them fuses linears, which moves their weights
            self.state, self._state_due = model_state(self.model), False
        return steps

    def eager_verifier(self) -> nn.Module:
        """The model as eager verification runs it (and the profiler times it): with its head packed where that
        applies (packed.py), made once and again whenever the model's head changes; else the model itself."""
        _, weight, bias = adapter.output_head(self.model)
        if self.verifier is None or self.verifier_source != head_source(weight, bias):
            head = packed_head(weight, bias)
            self.verifier = self.model if head is None else model_with_head(self.model, head)
            self.verifier_source = head_source(weight, bias)
        return self.verifier

    def _layers_for(self, backend: str) -> CompiledLayers:
        """The engine's compiled layers for `backend`, made once: each holds its functions under a name of its own."""
        if backend not in self.layers:
            self.layers[backend] = CompiledLayers(backend, fuse=backend == "inductor" and self.fuse_projections)
        return self.layers[backend]

    def _prefill(self, settings: CompileSettings) -> Prefill:
        """Compiled prefill steps where layers compile per width (regional: one compile per width, then a CUDA graph
        each on CUDA) on the devices where that pays (`COMPILED_PREFILL_DEVICES`); else the eager prefill, as in
        whole-step modes, where each width would be a whole-model compile."""
        regional = settings.resolved(self.model.device) == "regional"
        if not regional or self.model.device.type not in COMPILED_PREFILL_DEVICES:
            return Prefill(self.model, self.cache, attention=self.attention)
        compiled = self._layers_for(settings.backend)
        for width in PREFILL_WIDTHS:
            if (width, settings) not in self.prefill_steps:
                self._state_due = True
                view = regional_view(self.model, None, self.cache, compiled)
                fn = functools.partial(forward_at_position, view, self.cache, logits_to_keep=self.prefill_row)
                self.prefill_steps[width, settings] = Step(fn, self.cache, compiled=True, graph_pool=self.graph_pool,
                                                           attention=self.attention)
        return Prefill(self.model, self.cache, {w: self.prefill_steps[w, settings] for w in PREFILL_WIDTHS},
                       self.prefill_row, self.attention)

    def release_cache(self) -> None:
        """Drop the cache and the steps that write it; the next compiled call makes a cache of its own length. The
        cache only grows otherwise, and every step attends over all its slots: on an H200, the default model's step
        costs 3.3x at 8,192 slots what it costs at 256, whatever the position (BENCHMARKS.md, twenty-first session)."""
        for skip, _ in self.draft_steps:
            forget_draft(self.model, skip)
        # The steps close over the old cache: freed first, so that the engine never holds two caches at once.
        self.verify_steps.clear()
        self.draft_steps.clear()
        self.draft_sources.clear()
        self.prefill_steps.clear()
        for compiled in self.layers.values():
            compiled.resized()
        self.cache, self.graph_pool, self.prefill_row = None, None, None

    def _fit_cache(self, length: int) -> None:
        model, device = self.model, self.model.device
        state = model_state(model) if self.state is not None else None
        if state is not None and state != self.state:  # the steps (and the drafts' copies) run what the model had
            if state[1][1:] != self.state[1][1:]:
                self.layers.clear()  # global hooks run in every layer: every kind compiled again, with them
            elif state[1] != self.state[1]:
                for compiled in self.layers.values():  # a layer's hooks are in its kind (regional.layer_hooks)
                    compiled.hooks_changed()
            self.release_cache()
            forget_drafts(model)
            self.state = None
        if any([compiled.fusion_lost() for compiled in self.layers.values()]):  # a list: every one resets
            self.release_cache()  # its steps (on CUDA, graphs reading the fused weights' addresses) read the old ones
        if self.cache is None or not self.cache.matches(length, model.dtype, device):
            self.release_cache()
            # A capacity in blocks serves many lengths with one cache, and so one set of captured CUDA graphs.
            self.cache = SpeculativeCache(model.config, -(-length // CACHE_BLOCK) * CACHE_BLOCK, device, model.dtype)
            self.graph_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
            self.prefill_row = torch.zeros(1, dtype=torch.long, device=device)
            if device.type == "cuda":
                torch._dynamo.mark_static_address(self.prefill_row)  # read in place by the prefill's CUDA graphs

    def _draft_step(self, skip: SkipSet, settings: CompileSettings) -> Step:
        key, source = (skip, settings), head_source(*adapter.output_head(self.model)[1:])
        # A trimmed head copied rows the model's head no longer has: the step is made again, but for frozen steps,
        # which hold every weight as compiled until `release_cache` (README).
        if (key in self.draft_steps and skip.head is not None and self.draft_sources.get(key) != source
                and settings.resolved(self.model.device) != "frozen"):
            del self.draft_steps[key]
            forget_draft(self.model, skip)
        if key in self.draft_steps:
            self.draft_steps.move_to_end(key)
            return self.draft_steps[key]
        self.draft_steps[key] = step = self._compiled_step(skip, settings)
        self.draft_sources[key] = source
        if settings.resolved(self.model.device) == "regional" and not self.layers[settings.backend].warmed:
            # In the first call's timed setup: the first skip set's setup time counts every kind's compile.
            step.prepare = lambda: self._warm_layer_kinds(settings)
        self._evict()
        return step

    def _evict(self) -> None:
        """Free the least recently used sets' draft steps past the bound, but none of the current call's sets: a call
        with more candidates than the bound keeps them all (each evicting another recompiled at every call)."""
        evictable = [key for key in self.draft_steps if key[0] not in self.call_sets]
        for key in evictable[: max(0, len(self.draft_steps) - self._kept_skip_sets)]:
            del self.draft_steps[key]
            self.draft_sources.pop(key, None)
            forget_draft(self.model, key[0])

    def _compiled_step(self, skip: SkipSet | None, settings: CompileSettings) -> Step:
        mode, cache = settings.resolved(self.model.device), self.cache
        self._state_due = True
        if mode == "regional":
            compiled = self._layers_for(settings.backend)
            return Step(_step(regional_view(self.model, skip, cache, compiled), cache), cache, compiled=True,
                        graph_pool=self.graph_pool, attention=self.attention)
        view, frozen = draft_model(self.model, skip) if skip else self.model, mode == "frozen"
        fn = torch.compile(own_code(_step(view, cache)), backend=settings.backend, mode=None if frozen else mode,
                           fullgraph=True, dynamic=False)
        return Step(fn, cache, compiled=True, attention=self.attention,
                    inductor_config=frozen_inductor_config(self.model.device) if frozen else None,
                    graph_pool=self.graph_pool if frozen else None,  # captured by hand on CUDA, as regional steps
                    tree_graphs=self.model.device.type == "cuda" and mode in ("reduce-overhead", "max-autotune"))

    def _warm_layer_kinds(self, settings: CompileSettings) -> None:
        """Compile every one-token layer kind now, with the first skip set: no later set compiles anything.
        Runs one forward of each kind through every layer (a family may vary its layers in ways the kind does not
        name, as SmolLM3's layers without rotary embeddings: dynamo compiles each variant now, not in a later trial)
        at the position (stale slots) and rolls the position back."""
        compiled = self._layers_for(settings.backend)
        compiled.warmed = True
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
        position = self.cache.position.clone()
        every = tuple(range(len(decoder_layers(self.model))))
        kinds = (SkipSet(attn=every), SkipSet(mlp=every), SkipSet(attn=every, mlp=every))
        with torch.inference_mode():
            for skip in (*kinds, None):
                forward_at_position(regional_view(self.model, skip, self.cache, compiled), self.cache, ids)
                self.cache.position.copy_(position)
            for skip in kinds:
                forget_draft(self.model, skip)


def _step(model: nn.Module, cache: SpeculativeCache) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(ids: torch.Tensor) -> torch.Tensor:
        return forward_at_position(model, cache, ids)

    return step


_MAKING_ENGINES = threading.Lock()  # threads starting on one new model at once get one engine, and one lock


def engine_for(model: nn.Module) -> Engine:
    """The model's engine, made on first use and kept on the model (it lives and dies with it)."""
    engine = model.__dict__.get("_skipsearch_engine")
    if engine is not None and engine.model is model:
        return engine
    with _MAKING_ENGINES:
        engine = model.__dict__.get("_skipsearch_engine")
        if engine is None or engine.model is not model:  # none yet, or a shallow copy's, which runs the original
            adapter.check_touchpoints(model)
            engine = Engine(model)
            object.__setattr__(model, "_skipsearch_engine", engine)
        return engine
