"""`export` and `plot`: a finished (or running) study's decision as a config file, and its plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..decode.config import SkipConfig, save_skip_config
from ..io.files import check_output_file, check_output_folder
from ..report.export import dataset_verdicts, export_trial, exported_text, verdict, write_dv
from ..report.plots import write_plots
from .options import StudyOptions


@dataclass(frozen=True)
class ExportSettings(StudyOptions):
    trial: int | None = None  # None: the study's confirmed decision
    format: str = "skipsearch"  # or "dv": Draft & Verify / SWIFT's skip_layers.json
    output: Path | None = None  # None: <studies_dir>/<study_name>/best.json (skip_layers.json with "dv")


@dataclass(frozen=True)
class Export:
    config: SkipConfig
    path: Path
    verdicts: list[str]  # the study's verdict and its datasets' (none for a trial asked by number)

    @property
    def line(self) -> str:
        return f"exported {self.path}: {exported_text(self.config)}"


def export_study(settings: ExportSettings) -> Export:
    """Write the study's decision (or trial `settings.trial`) as `python -m skipsearch export` does."""
    s = settings
    output = s.output or s.folder / ("skip_layers.json" if s.format == "dv" else "best.json")
    # The flag the user gave: a default path under a --studies-dir that is a file names that, not an unseen --output.
    check_output_file(output, "--output" if s.output else "--studies-dir", inside=None if s.output else s.studies_dir)
    study = s.load_study()
    config = export_trial(study, output, s.trial, write=write_dv if s.format == "dv" else save_skip_config)
    verdicts = [verdict(study)[1], *dataset_verdicts(study)] if s.trial is None else []
    return Export(config, output, verdicts)


def plot_study(settings: StudyOptions, output: Path | None = None) -> list[Path]:
    """Write the study's plots (into `<studies_dir>/<study_name>/plots` by default); returns their files."""
    flag, inside = ("--output", None) if output else ("--studies-dir", settings.studies_dir)
    output = output or settings.folder / "plots"
    check_output_folder(output, flag, inside=inside)
    study = settings.load_study()
    if not any(t.state.name == "COMPLETE" for t in study.trials):
        raise ValueError(f"study {settings.study_name!r} has no completed trial to plot yet")
    return write_plots(study, output)
