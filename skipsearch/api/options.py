"""Options that several commands share (the model, the draft policy, the study), as typed values the command line
fills from its flags and Python callers fill by name; each field is the flag of the same name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import optuna

from ..decode.policy import DraftPolicy
from ..decode.provenance import ConfigSearch
from ..io import models
from ..io.files import read_json
from ..search.records import STUDY_ATTR, read_label
from ..search.storage import default_storage, load_study


@dataclass(frozen=True)
class ModelOptions:
    model: str | None = None  # a Hugging Face name, a local folder or a GGUF file (None: the embedded default)
    device: str | None = None
    dtype: str | None = None

    def load(self) -> models.LoadedModel:
        return models.load_model(self.model, device=self.device, dtype=self.dtype)


@dataclass(frozen=True)
class DraftOptions:
    """The drafting flags, over a base policy (a config's, else DraftPolicy's defaults)."""

    max_draft_tokens: int | None = None
    fixed_draft: bool = False
    no_guard: bool = False

    def policy(self, base: DraftPolicy = DraftPolicy()) -> DraftPolicy:
        return DraftPolicy(
            max_draft_tokens=base.max_draft_tokens if self.max_draft_tokens is None else self.max_draft_tokens,
            adaptive=base.adaptive and not self.fixed_draft,
            guard=base.guard and not self.no_guard,
        )


@dataclass(frozen=True)
class StudyOptions:
    """Where a study lives: `storage` (any Optuna storage URL), else `<studies_dir>/<study_name>.db`."""

    study_name: str = "default"
    studies_dir: Path = Path("studies")
    storage: str | None = None

    @property
    def folder(self) -> Path:
        """The study's exports and plots."""
        return self.studies_dir / self.study_name

    def storage_url(self, must_exist: bool) -> str:
        if self.storage:
            return self.storage
        database = self.studies_dir / f"{self.study_name}.db"
        if must_exist and not database.is_file():
            categories = _category_studies(self.folder / "best.json")
            if categories:
                raise ValueError(f"no study database at {database}: `optimize --per-category` made one study per "
                                 f"category, {', '.join(categories)}: give one of them to --study-name")
            raise ValueError(f"no study database at {database}: run `python -m skipsearch optimize` first, "
                             "or give --storage / --studies-dir")
        return default_storage(self.study_name, self.studies_dir)

    def load_study(self) -> optuna.Study:
        """The study, refused unless skipsearch made it."""
        study = load_study(self.study_name, self.storage_url(must_exist=True))
        try:
            label = read_label(study)
        except ValueError:
            raise ValueError(f"study {self.study_name!r} has a damaged {STUDY_ATTR!r} attribute") from None
        if label is None:
            raise not_made_by_skipsearch(self.study_name)
        return study


def _category_studies(exported: Path) -> list[str]:
    """The category studies an `optimize --per-category` export names (none where `exported` is not one)."""
    try:
        data = read_json(exported, "export")
        search = ConfigSearch.from_json(data.get("search", {}) if isinstance(data, dict) else None, "search",
                                        str(exported))
    except (OSError, ValueError):  # no such export: the plain "no study database" applies
        return []
    return [name for name in (search.category_studies or {}).values() if name is not None]


def not_made_by_skipsearch(name: str) -> ValueError:
    return ValueError(f"study {name!r} was not made by skipsearch (it has no {STUDY_ATTR!r} attribute): "
                      "give another --study-name")


def special_token_ids(loaded: models.LoadedModel) -> list[int]:
    """The tokens a trimmed draft head always holds: the model's EOS ids first (a draft that cannot propose the end
    stops no round), then the tokenizer's special tokens."""
    eos = loaded.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return list(dict.fromkeys([*eos, *loaded.tokenizer.all_special_ids]))
