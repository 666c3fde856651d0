"""Split Spec-Bench (or any prompt file with categories) into calibration and held-out prompts, per category.

    python benchmarks/spec_bench_split.py question.jsonl --calibration 4 --held-out 4 --output-dir studies/spec-bench

Each category's rows are shuffled with the seed (as `optimize` and `bench` draw them); the first `--calibration` go
to calibration.jsonl, the next `--held-out` to held_out.jsonl, so that no held-out prompt was calibrated on. Rows are
written as {"category", "turns", "source"}: read them with `--field turns`. MT-bench's subcategories are one category,
as Spec-Bench reports them. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skipsearch.io.data import load_rows, shuffled_by_category
from skipsearch.io.files import write_atomic


def split(path: str, field: str, calibration: int, held_out: int, seed: int, category_field: str | None = None
          ) -> tuple[list[dict], list[dict]]:
    """(calibration rows, held-out rows), `calibration` and `held_out` of each category, never the same row."""
    groups = shuffled_by_category(load_rows(path, field, num_prompts=None, seed=seed, category_field=category_field),
                                  seed)
    if None in groups:
        raise ValueError(f"{path}: the rows have no category (name the field with --category-field)")
    short = next((c for c, rows in groups.items() if len(rows) < calibration + held_out), None)
    if short is not None:
        raise ValueError(f"category {short!r} has {len(groups[short])} prompts, fewer than {calibration + held_out}")

    def written(rows: list) -> list[dict]:
        return [{"category": row.category, "turns": list(row.turns), "source": row.where} for row in rows]

    return ([r for rows in groups.values() for r in written(rows[:calibration])],
            [r for rows in groups.values() for r in written(rows[calibration:calibration + held_out])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", help="a JSON/JSONL file of prompts with categories, e.g. Spec-Bench's "
                                        "question.jsonl")
    parser.add_argument("--field", default="turns", help="the prompt field (default: turns)")
    parser.add_argument("--category-field", default=None, help="the category field (default: category)")
    parser.add_argument("--calibration", type=int, default=4, help="calibration prompts per category (default: 4)")
    parser.add_argument("--held-out", type=int, default=4, help="held-out prompts per category (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default: 0)")
    parser.add_argument("--output-dir", type=Path, default=Path("studies/spec-bench"))
    args = parser.parse_args(argv)
    try:
        calibration, held_out = split(args.dataset, args.field, args.calibration, args.held_out, args.seed,
                                      args.category_field)
    except ValueError as error:
        print(f"spec_bench_split: {error}", file=sys.stderr)
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("calibration.jsonl", calibration), ("held_out.jsonl", held_out)):
        write_atomic(args.output_dir / name, "".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {args.output_dir / name}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
