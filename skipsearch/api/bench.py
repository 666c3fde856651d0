"""`bench`: skipsearch beside HF greedy and its training-free peers on the same prompts, written as JSON and a chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..costs.profiler import contexts_for, device_name, profile_costs
from ..decode.config import SkipConfig, load_skip_config
from ..decode.cost_profile import CostProfile
from ..io.data import BUILTIN, load_prompts
from ..io.files import check_output_folder
from ..io.models import LoadedModel
from ..report.bench import BenchRow, bench_verdict, format_table, run_bench, write_outputs
from ..report.projections import load_projections
from .options import ModelOptions, encoded_prompts


@dataclass(frozen=True)
class BenchSettings(ModelOptions):
    """`python -m skipsearch bench`'s flags, by name, with its defaults."""

    config: Path | None = None
    early_exit_layer: int | None = None
    prompt_lookup_tokens: int = 10
    repeats: int = 3
    cost_profile: Path | None = None
    project_with: list[Path] | None = None
    seed: int = 0
    output_dir: Path | None = None  # None: <studies_dir>/bench
    studies_dir: Path = Path("studies")
    no_progress: bool = False
    dataset: str = BUILTIN
    field: str = "prompt"
    split: str = "train"
    num_prompts: int = 4
    max_new_tokens: int = 48
    raw: bool = False
    compile: bool = False


@dataclass(frozen=True)
class Benchmark:
    rows: list[BenchRow]
    verdict: str | None
    json_path: Path
    png_path: Path

    def lines(self) -> list[str]:
        """The table, each row's predictions on other devices, and the verdict, as `bench` prints them."""
        predictions = [f"PREDICTION (cost model, not measured) on {label}: {row.method} {speedup:.2f}x over plain "
                       "decoding" for row in self.rows for label, speedup in (row.projected_speedups or {}).items()]
        return [format_table(self.rows), *predictions, *([self.verdict] if self.verdict else [])]


def benchmark(settings: BenchSettings) -> Benchmark:
    """Decode the prompts with every method as `python -m skipsearch bench` does, and write bench.json / .png."""
    s = settings
    prompts = load_prompts(s.dataset, field=s.field, split=s.split, num_prompts=s.num_prompts, seed=s.seed)
    output_dir = s.output_dir or s.studies_dir / "bench"
    check_output_folder(output_dir, "--output-dir" if s.output_dir else "--studies-dir")
    if s.config and load_skip_config(s.config).others:  # a broken file is reported before the model loads
        raise ValueError(f"--config {str(s.config)!r} carries several skip sets: bench measures one; "
                         "`generate --config` chooses among them per prompt")
    if s.cost_profile:
        CostProfile.load(s.cost_profile)
    loaded = s.load()
    config = load_skip_config(s.config, loaded.model, loaded.tokenizer) if s.config else None
    if s.project_with and (config is None or not config.skip.drafts):
        raise ValueError("--project-with needs a --config that skips something")
    projections = load_projections(s.project_with or (), loaded.model)
    num_layers = loaded.model.config.num_hidden_layers
    if s.early_exit_layer is not None and not 1 <= s.early_exit_layer < num_layers:
        raise ValueError(f"--early-exit-layer must be in 1..{num_layers - 1} for this model, got {s.early_exit_layer}")
    encoded = encoded_prompts(loaded, prompts, s.raw, s.max_new_tokens, max_draft_tokens=16)
    rows = run_bench(loaded.model, encoded, s.max_new_tokens, loaded.model.generation_config.eos_token_id,
                     config=config, early_exit_layer=s.early_exit_layer,
                     prompt_lookup_tokens=s.prompt_lookup_tokens, repeats=s.repeats,
                     profile=_profile(s, loaded, config, encoded), show_progress=not s.no_progress,
                     project_with=projections, compile=s.compile)
    verdict = bench_verdict(rows, config)
    json_path, png_path = write_outputs(rows, output_dir, _written_settings(s, loaded, len(prompts)), verdict)
    return Benchmark(rows, verdict, json_path, png_path)


def _profile(s: BenchSettings, loaded: LoadedModel, config: SkipConfig | None, encoded: list[list[int]]
             ) -> CostProfile | None:
    """The cost profile that prices the config's predicted speedup: --cost-profile's, else this device's."""
    if config is None or not config.skip.drafts:
        return None
    if s.cost_profile:
        profile = CostProfile.load(s.cost_profile)
        profile.check_model(loaded.model)
        return profile
    return profile_costs(loaded.model, contexts=contexts_for(loaded.model, encoded, s.max_new_tokens),
                         show_progress=not s.no_progress)


def _written_settings(s: BenchSettings, loaded: LoadedModel, num_prompts: int) -> dict:
    """The settings bench.json records beside its rows."""
    return {"model": loaded.name_or_path, "device": str(loaded.device), "dtype": loaded.dtype_name,
            "dataset": s.dataset, "num_prompts": num_prompts, "max_new_tokens": s.max_new_tokens,
            "repeats": s.repeats, "config": str(s.config) if s.config else None,
            "device_name": device_name(loaded.device), "torch_threads": torch.get_num_threads(),
            "project_with": [str(p) for p in s.project_with or ()]}
