"""Calibration prompts through `datasets`: the built-in set, a local JSON/JSONL file, or a Hub dataset.

A prompt field may hold text or a list of user turns (a conversation, as Spec-Bench's `turns`); a `category` field
(or another, named) is kept with each prompt, and then the draw is stratified: every category is represented. A
`category` field read without being named is left out, with a note, where it cannot stratify the draw.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import first_line
from .files import read_json

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).parent.parent / "prompts" / "builtin.jsonl"
CATEGORY_FIELD = "category"  # read without a flag when the rows have it
NO_CATEGORIES = "none"  # as the category field: categories off, the draw unstratified
# Spec-Bench reports MT-bench's eight subcategories together, as "multi-turn conversation", and its tasks in this order.
MT_BENCH = "mt_bench"
MT_BENCH_SUBCATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_ORDER = (MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its user turns (one, or several: each after the model's own answer to the one before), its
    category (None: the dataset has none) and where it was read ("line 3"), for messages about it."""

    turns: tuple[str, ...]
    category: str | None = None
    where: str = ""


def load_prompts(
    dataset: str = BUILTIN, field: str = "prompt", split: str = "train", num_prompts: int | None = 8, seed: int = 0
) -> list[str]:
    """`num_prompts` prompts' first turns (all when None), chosen by a seeded shuffle so a seed always picks the same
    ones; `load_rows` keeps every turn and the category."""
    return [row.turns[0] for row in load_rows(dataset, field, split, num_prompts, seed)]


def note_on_stderr(line: str) -> None:
    print(f"note: {line}", file=sys.stderr)


def prompt_digest(turns: Sequence[str]) -> str:
    """A prompt's fingerprint: a skip config names the prompts its study decoded or ranked its head on by these (not
    their text, which may be private), so that `bench` can measure it on others."""
    return hashlib.sha256(json.dumps(list(turns)).encode()).hexdigest()[:16]  # JSON: turns cannot run together


def load_rows(dataset: str = BUILTIN, field: str = "prompt", split: str = "train", num_prompts: int | None = 8,
              seed: int = 0, category_field: str | None = None,
              note: Callable[[str], None] = note_on_stderr, study_prompts: Collection[str] = ()) -> list[PromptRow]:
    """`num_prompts` rows (all when None), drawn by a seeded shuffle, stratified by category when the rows have one.

    `dataset` is "builtin" (32 prompts shipped with skipsearch: chat, explanation,
    summarization of a given passage, code), a local .json / .jsonl file, or a Hub name. `category_field`: the field
    naming each row's category, which every row must then have; "none" (NO_CATEGORIES): no categories; None:
    "category" where the rows have it, left out (`note` says why) where a row has no text in it or it has more
    categories than `num_prompts`, which could not all be represented. `study_prompts`: digests (`prompt_digest`) of
    rows to leave out before the draw, as a config's study saw them (`note` says how many).
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    path = BUILTIN_PATH if dataset == BUILTIN else Path(dataset)
    if dataset == BUILTIN or path.suffix in (".json", ".jsonl") or path.exists():
        records = _json_records(path, dataset)
    else:
        records = _hub_records(dataset, split)
    rows, unusable = _rows(records, dataset, field, category_field)
    empty = len(records) - len(rows)
    rows = _held_out(rows, study_prompts, dataset, note)
    held_out = len(records) - empty - len(rows)
    kinds = len(categories_of(rows))
    if category_field is None and not unusable and num_prompts is not None and kinds > num_prompts:
        unusable = f"its {kinds} categories are more than the {num_prompts} prompts asked for"
    if unusable:  # only where no flag named the field: a field the user named is refused instead
        note(f"dataset {dataset!r} is drawn without categories: {unusable} (--category-field {CATEGORY_FIELD} to "
             f"require them; --category-field {NO_CATEGORIES} to leave them out without this note)")
        rows = [replace(row, category=None) for row in rows]
    if not rows and not held_out:
        raise ValueError(f"dataset {dataset!r} has no non-empty text in field {field!r}")
    if num_prompts is not None and num_prompts > len(rows) or not rows:
        raise ValueError(f"asked for {num_prompts or 'prompts'}{' prompts' if num_prompts else ''}, but dataset "
                         f"{dataset!r} has {len(rows)}"
                         + (f" besides the {held_out} its config's study saw (--include-study-prompts keeps those, "
                            "for an in-sample figure; or give another --dataset)" if held_out else "")
                         + (f" ({empty} of its {len(records)} rows have no text in field {field!r})" if empty else ""))
    return draw(rows, num_prompts, seed)


def _held_out(rows: list[PromptRow], study_prompts: Collection[str], dataset: str,
              note: Callable[[str], None]) -> list[PromptRow]:
    """The rows whose digest is not among `study_prompts`, with a note of how many were left out."""
    kept = [row for row in rows if prompt_digest(row.turns) not in study_prompts]
    if len(kept) < len(rows):
        note(f"{len(rows) - len(kept)} prompts of dataset {dataset!r} left out: the config's study decoded them or "
             "ranked its draft head on them, so a figure on them would be in-sample (--include-study-prompts keeps "
             "them)")
    return kept


def categories_of(rows: list[PromptRow]) -> list[str]:
    """The rows' categories in Spec-Bench's order (its tasks first, then the others as they first appear)."""
    present = dict.fromkeys(row.category for row in rows if row.category is not None)
    return [c for c in SPEC_BENCH_ORDER if c in present] + [c for c in present if c not in SPEC_BENCH_ORDER]


def shuffled_by_category(rows: list[PromptRow], seed: int) -> dict[str | None, list[PromptRow]]:
    """Each category's rows (one group, None, without categories) in a seeded shuffle: every draw takes from the front,
    so a seed always picks the same rows and a larger draw holds a smaller one."""
    generator = random.Random(seed)
    groups = {c: [row for row in rows if row.category == c] for c in categories_of(rows) or [None]}
    for group in groups.values():
        generator.shuffle(group)
    return groups


def draw(rows: list[PromptRow], num_prompts: int | None, seed: int) -> list[PromptRow]:
    """`num_prompts` rows (None: all), taken in turn from each category's shuffle, so that every category is
    represented and a trial stopped early has measured each; refused when there are more categories than prompts."""
    groups = shuffled_by_category(rows, seed)
    if num_prompts is not None and num_prompts < len(groups):
        raise ValueError(f"--num-prompts {num_prompts} cannot represent the dataset's {len(groups)} categories "
                         f"({', '.join(map(str, groups))}): give at least {len(groups)}, or --category-field "
                         f"{NO_CATEGORIES} to draw without them")
    interleaved = [group[i] for i in range(max(map(len, groups.values()))) for group in groups.values()
                   if i < len(group)]
    return interleaved[:num_prompts]


def draw_per_category(rows: list[PromptRow], per_category: int, seed: int) -> dict[str, list[PromptRow]]:
    """`per_category` rows of each category (the front of its shuffle, as `draw` takes them)."""
    groups = shuffled_by_category(rows, seed)
    if None in groups:  # rows read without categories: optimize --per-category names the field, so that it is refused
        raise ValueError("the dataset's rows have no category: name the field with --category-field")
    short = next((c for c, group in groups.items() if len(group) < per_category), None)
    if short is not None:
        raise ValueError(f"category {short!r} has {len(groups[short])} prompts, fewer than --num-prompts "
                         f"{per_category}")
    return {c: group[:per_category] for c, group in groups.items()}


def _hub_records(dataset: str, split: str) -> list[tuple[str, dict]]:
    """The rows of Hub dataset `dataset` ("name", or "name:config" for one of its configs: a Hub name holds no
    colon) in `split`. Where the Hub cannot be reached, datasets is asked offline, which reads its cache at once
    (online, it would retry the Hub and log each failed try)."""
    import datasets

    from .models import hub_unreachable  # here: models imports torch, which reading the builtin prompts does without
    from .refusals import load_error

    datasets.disable_progress_bars()
    name, _, config = dataset.partition(":")
    unreachable = hub_unreachable()
    try:
        with _hub_offline(unreachable is not None):
            rows = datasets.load_dataset(name, config or None, split=split)
    except Exception as error:  # noqa: BLE001 - datasets raises many kinds; load_error keeps the machine's faults
        configs = re.search(r"available configs: (\[[^\]]*\])", str(error))  # on a line of its own
        reason = (f"it has configs {configs.group(1)}: give one as --dataset {name}:CONFIG" if configs else
                  f"no such local file, not in the datasets cache, and the Hub cannot be asked ({unreachable})"
                  if unreachable else first_line(error))
        raise load_error(error, f"cannot read dataset {dataset!r}: {reason}") from None
    # A ClassLabel column (a category, say) holds each label's index; its names are what the rows mean (-1: none).
    labels = {column: feature.names for column, feature in (rows.features or {}).items()
              if isinstance(feature, datasets.ClassLabel)}
    records = rows.to_list()
    for record in records:
        for column, names in labels.items():
            if isinstance(record.get(column), int):
                record[column] = names[record[column]] if 0 <= record[column] < len(names) else None
    return [(f"row {number}", record) for number, record in enumerate(records, start=1)]


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """datasets and huggingface_hub in offline mode for the `with` block where `offline`: both read their switch at
    each call, which HF_HUB_OFFLINE=1 sets for the whole process."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _rows(records: list[tuple[str, dict]], name: str, field: str,
          category_field: str | None) -> tuple[list[PromptRow], str | None]:
    """The rows whose `field` holds non-empty text or a list of turns, and why the categories cannot be used (None:
    they can, or none are read). A record whose field holds anything else (or a list with an empty or non-text turn,
    or no category in the field named) is refused, naming its line or index; a row without text in the `category`
    field read unnamed leaves the categories out, since no flag asked for them.

    Local files are read here rather than by `datasets.load_dataset("json")`, which would leave an Arrow cache under
    HF_HOME even for a file it rejects, and logs a second line beside its error.
    """
    named = category_field not in (None, NO_CATEGORIES)
    for wanted in (field, category_field if named else None):
        if wanted is not None and not any(wanted in record for _, record in records):
            fields = sorted({key for _, record in records for key in record})
            raise ValueError(f"dataset {name!r} has no field {wanted!r}: its fields are {', '.join(fields)}"
                             + (" (--category-field NAME names the one that holds categories)"
                                if wanted == category_field else ""))
    read = category_field if named else CATEGORY_FIELD if category_field is None and any(
        CATEGORY_FIELD in record for _, record in records) else None
    rows, unusable = [], None
    for where, record in records:
        turns = _turns(record.get(field), f"dataset {name!r}, {where}: {field!r}")
        if not turns:
            continue
        category, fault = _category(record, read) if read else (None, None)
        if fault and named:
            raise ValueError(f"dataset {name!r}, {where}: {fault} (a category is read from each row, as "
                             f"--category-field asks; --category-field {NO_CATEGORIES} reads none)")
        unusable = unusable or (f"{where} has {fault}" if fault else None)
        rows.append(PromptRow(turns, category, where))
    return _as_spec_bench(rows), unusable


def _as_spec_bench(rows: list[PromptRow]) -> list[PromptRow]:
    """Spec-Bench's rows with MT-bench's subcategories as one category, as Spec-Bench reports them. Only rows of
    Spec-Bench's categories alone, one of its own tasks among them, are read so: another dataset's "math" or
    "writing" is a category of its own."""
    categories = {row.category for row in rows}
    if not categories & set(SPEC_BENCH_ORDER[1:]) or not categories <= {*SPEC_BENCH_ORDER, *MT_BENCH_SUBCATEGORIES}:
        return rows
    return [replace(row, category=MT_BENCH) if row.category in MT_BENCH_SUBCATEGORIES else row for row in rows]


def _kind(value: object) -> str:
    return "a number" if isinstance(value, (int, float)) and not isinstance(value, bool) else \
        f"a {type(value).__name__}"


def _turns(value: object, where: str) -> tuple[str, ...]:
    """A prompt's turns: text (none when empty or null: the row is left out), or a list of non-empty texts."""
    if value is None or isinstance(value, str):
        return (value,) if value is not None and value.strip() else ()
    if not isinstance(value, list):
        raise ValueError(f"{where} is {_kind(value)} ({_shown(value)}), not text or a list of turns")
    if not value:
        raise ValueError(f"{where} is an empty list: a conversation needs at least one turn")
    for number, turn in enumerate(value, start=1):
        if not isinstance(turn, str):
            raise ValueError(f"{where}: turn {number} is {_kind(turn)} ({_shown(turn)}), not text")
        if not turn.strip():
            raise ValueError(f"{where}: turn {number} is empty")
    return tuple(value)


def _shown(value: object) -> str:
    """A value as a message quotes it: JSON, and what JSON cannot hold (a Hub dataset's datetime, bytes, an image's
    dict of bytes) by its repr, so that the message is raised rather than json's TypeError; cut to a readable length."""
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError, RecursionError):  # keys JSON cannot hold (a tuple), a value holding itself
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _category(record: dict, field: str) -> tuple[str | None, str | None]:
    """The row's category, as its field names it, or None and what the row has instead ("no 'category' field")."""
    if field not in record:
        return None, f"no {field!r} field"
    value = record[field]
    if isinstance(value, str) and value.strip():
        return value, None
    found = ("a null" if value is None else "an empty" if isinstance(value, str) else
             f"{_kind(value)} ({_shown(value)}) in its")
    return None, f"{found} {field!r} field"


def _json_records(path: Path, name: str) -> list[tuple[str, dict]]:
    """(where, record) pairs: "line N" in JSON Lines, "record N" in a JSON document, which a .jsonl file may hold too
    (a pretty-printed list of objects: its first line alone, "[", is no JSON, the whole file is)."""
    if path.suffix == ".json":
        return _json_file_records(path, name)
    try:
        return _json_lines_records(path, name)
    except ValueError as lines:
        try:
            document = read_json(path, "dataset")
        except ValueError:
            raise lines from None
    return _document_records(document, name)


def _json_file_records(path: Path, name: str) -> list[tuple[str, dict]]:
    """A .json file's records: one JSON document, or JSON Lines, which datasets accepts in a .json file too. When
    neither parses, the error is the one of what the file looks like: JSON Lines when its first line is an object
    alone, else a document (whose JSON Lines error, "line 1: cut short", would mislead)."""
    try:
        document = read_json(path, "dataset")
    except ValueError as whole:
        try:
            return _json_lines_records(path, name)
        except ValueError as lines:
            raise (lines if _first_line_is_an_object(path) else whole) from None
    return _document_records(document, name)


def _first_line_is_an_object(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (UnicodeDecodeError, OSError):  # both reads said so already: their error, which names the file, is raised
        return False
    first = next((line for line in text.split("\n") if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except (ValueError, RecursionError):
        return False


def _json_lines_records(path: Path, name: str) -> list[tuple[str, dict]]:
    records = []
    for number, row in read_json(path, "dataset", lines=True):
        if not isinstance(row, dict):
            raise ValueError(f"dataset {name!r}, line {number}: expected an object such as {{\"prompt\": \"...\"}}")
        records.append((f"line {number}", row))
    if not records:
        raise ValueError(f"dataset {name!r} is empty")
    return records


def _document_records(data: object, name: str) -> list[tuple[str, dict]]:
    """A JSON document's records: a list of objects, an object of equal-length lists (columns), or one object whose
    values are not all lists (a one-row JSON Lines file saved as .json)."""
    if isinstance(data, list):
        if not all(isinstance(row, dict) for row in data):
            raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
        records = [(f"record {index}", row) for index, row in enumerate(data, start=1)]
    elif isinstance(data, dict) and data and not all(isinstance(c, list) for c in data.values()):
        records = [("record 1", data)]
    elif isinstance(data, dict):  # columns: {"prompt": ["...", "..."]}
        columns = list(data.values())
        if columns and not all(len(c) == len(columns[0]) for c in columns):
            raise ValueError(f"dataset {name!r}: expected a list of objects, or an object of equal-length lists")
        records = [(f"record {index}", dict(zip(data, row))) for index, row in enumerate(zip(*columns), start=1)]
    else:
        raise ValueError(f"dataset {name!r}: expected a list of objects such as {{\"prompt\": \"...\"}}")
    if not records:
        raise ValueError(f"dataset {name!r} has no rows")
    return records
