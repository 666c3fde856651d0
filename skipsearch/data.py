"""Calibration prompts through `datasets`: the built-in set, a local JSON/JSONL file, or a Hub dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).parent / "prompts" / "builtin.jsonl"


def load_prompts(
    dataset: str = BUILTIN, field: str = "prompt", split: str = "train", num_prompts: int | None = 8, seed: int = 0
) -> list[str]:
    """`num_prompts` prompts (all when None), chosen by a seeded shuffle so a seed always picks the same ones.

    `dataset` is "builtin" (32 prompts shipped with skipsearch: chat, explanation,
    summarization of a given passage, code), a local .json / .jsonl file, or a Hub name.
    """
    import datasets

    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    datasets.disable_progress_bars()
    path = BUILTIN_PATH if dataset == BUILTIN else Path(dataset)
    if dataset == BUILTIN or path.suffix in (".json", ".jsonl") or path.exists():
        rows = _local_rows(path, dataset)
    else:
        from .models import hub_unreachable

        reason = hub_unreachable()
        if reason:
            raise ValueError(f"cannot read dataset {dataset!r}: no such local file, and the Hub cannot be asked ({reason})")
        try:
            rows = datasets.load_dataset(dataset, split=split)
        except Exception as error:  # datasets raises many kinds; the user needs one line
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"cannot read dataset {dataset!r}: {reason}") from None
    if field not in rows.column_names:
        raise ValueError(f"dataset {dataset!r} has no field {field!r}: its fields are {', '.join(rows.column_names)}")
    prompts = [text for text in rows[field] if isinstance(text, str) and text.strip()]
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no non-empty text in field {field!r}")
    if num_prompts is not None and num_prompts > len(prompts):
        raise ValueError(f"asked for {num_prompts} prompts, but dataset {dataset!r} has {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts]


def _local_rows(path: Path, name: str) -> "datasets.Dataset":  # noqa: F821
    """A local .json (a list of records) or .jsonl file, checked line by line, as an in-memory Dataset.

    Parsed here rather than by `datasets.load_dataset("json")`, which would leave an Arrow cache under
    HF_HOME even for a file it rejects, and logs a second line beside its error.
    """
    import datasets

    if path.is_dir():
        raise ValueError(f"dataset {name!r} is a folder: give a .json or .jsonl file")
    if not path.is_file():
        raise ValueError(f"dataset file {name!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"dataset {name!r} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot read dataset {name!r}: {error.strerror or error}") from None
    records = _json_records(text, name, lines=path.suffix != ".json")
    try:
        return datasets.Dataset.from_list(records)
    except Exception as error:  # pyarrow: one field with values of different types
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot read dataset {name!r}: {reason}") from None


def _json_records(text: str, name: str, lines: bool) -> list[dict]:
    if not lines:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # maybe JSON lines in a .json file, which datasets accepts too
        if isinstance(data, list):
            if not all(isinstance(row, dict) for row in data):
                raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
            return data
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
        if isinstance(data, dict):  # columns: {"prompt": ["...", "..."]}
            columns = list(data.values())
            if not all(isinstance(c, list) and len(c) == len(columns[0]) for c in columns):
                raise ValueError(f"dataset {name!r}: expected a list of objects, or an object of equal-length lists")
            return [dict(zip(data, row)) for row in zip(*columns)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"dataset {name!r}, line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"dataset {name!r}, line {number}: expected an object such as {{\"prompt\": \"...\"}}")
        records.append(row)
    if not records:
        raise ValueError(f"dataset {name!r} is empty")
    return records
