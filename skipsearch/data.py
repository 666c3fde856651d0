"""Calibration prompts through `datasets`: the built-in set, a local JSON/JSONL file, or a Hub dataset."""

from __future__ import annotations

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
    try:
        if dataset == BUILTIN or path.suffix in (".json", ".jsonl"):
            if not path.is_file():
                raise ValueError(f"dataset file {dataset!r} does not exist")
            rows = datasets.load_dataset("json", data_files=str(path), split="train")
        else:
            rows = datasets.load_dataset(dataset, split=split)
    except ValueError:
        raise
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
