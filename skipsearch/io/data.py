"""Calibration prompts through `datasets`: the built-in set, a local JSON/JSONL file, or a Hub dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

from .files import read_json

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).parent.parent / "prompts" / "builtin.jsonl"


def load_prompts(
    dataset: str = BUILTIN, field: str = "prompt", split: str = "train", num_prompts: int | None = 8, seed: int = 0
) -> list[str]:
    """`num_prompts` prompts (all when None), chosen by a seeded shuffle so a seed always picks the same ones.

    `dataset` is "builtin" (32 prompts shipped with skipsearch: chat, explanation,
    summarization of a given passage, code), a local .json / .jsonl file, or a Hub name.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    path = BUILTIN_PATH if dataset == BUILTIN else Path(dataset)
    if dataset == BUILTIN or path.suffix in (".json", ".jsonl") or path.exists():
        prompts = _local_prompts(path, dataset, field)
    else:
        prompts = _hub_prompts(dataset, field, split)
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no non-empty text in field {field!r}")
    if num_prompts is not None and num_prompts > len(prompts):
        raise ValueError(f"asked for {num_prompts} prompts, but dataset {dataset!r} has {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    return prompts[:num_prompts]


def _hub_prompts(dataset: str, field: str, split: str) -> list[str]:
    import datasets

    from .models import hub_unreachable  # here: models imports torch, which reading the builtin prompts does without

    datasets.disable_progress_bars()
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
    return [text for text in rows[field] if isinstance(text, str) and text.strip()]


def _local_prompts(path: Path, name: str, field: str) -> list[str]:
    """The non-empty texts of `field` in a local .json (a list of records, or an object of columns) or .jsonl
    file; a record whose field holds anything but text (or null) is refused, naming its line or index.

    Read here rather than by `datasets.load_dataset("json")`, which would leave an Arrow cache under HF_HOME even
    for a file it rejects, and logs a second line beside its error.
    """
    records = _json_records(path, name)
    if not any(field in record for _, record in records):
        fields = sorted({key for _, record in records for key in record})
        raise ValueError(f"dataset {name!r} has no field {field!r}: its fields are {', '.join(fields)}")
    prompts = []
    for where, record in records:
        text = record.get(field)
        if text is not None and not isinstance(text, str):
            kind = "a number" if isinstance(text, (int, float)) and not isinstance(text, bool) else \
                f"a {type(text).__name__}"
            raise ValueError(f"dataset {name!r}, {where}: {field!r} is {kind} ({json.dumps(text)[:40]}), not text")
        if text is not None and text.strip():
            prompts.append(text)
    return prompts


def _json_records(path: Path, name: str) -> list[tuple[str, dict]]:
    """(where, record) pairs: "line N" in JSON Lines, "record N" in a JSON document."""
    if path.suffix == ".json":
        try:
            document = read_json(path, "dataset")
        except ValueError:
            document = None  # maybe JSON lines in a .json file, which datasets accepts too
        if document is not None:
            return _document_records(document, name)
    records = []
    for number, row in read_json(path, "dataset", lines=True):
        if not isinstance(row, dict):
            raise ValueError(f"dataset {name!r}, line {number}: expected an object such as {{\"prompt\": \"...\"}}")
        records.append((f"line {number}", row))
    if not records:
        raise ValueError(f"dataset {name!r} is empty")
    return records


def _document_records(data: object, name: str) -> list[tuple[str, dict]]:
    if isinstance(data, list):
        if not all(isinstance(row, dict) for row in data):
            raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
        return [(f"record {index}", row) for index, row in enumerate(data, start=1)]
    if isinstance(data, dict):  # columns: {"prompt": ["...", "..."]}
        columns = list(data.values())
        if not columns or not all(isinstance(c, list) and len(c) == len(columns[0]) for c in columns):
            raise ValueError(f"dataset {name!r}: expected a list of objects, or an object of equal-length lists")
        return [(f"record {index}", dict(zip(data, row))) for index, row in enumerate(zip(*columns), start=1)]
    raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
