"""Why someone else's model files cannot be loaded, in one line that names the file.

A model folder, GGUF file, tokenizer or chat template may come from anyone. What skipsearch refuses, it refuses before
anything in them runs: checkpoints are unpickled weights only (torch's `weights_only`), templates render in jinja's
sandbox, remote code is never trusted (`trust_remote_code=False`, never None: None makes transformers ask on a
terminal, where one keystroke would run the folder's code). The parsers of these files raise whatever they raise
(pickle, jinja, the tokenizers' Rust, sentencepiece, safetensors): `load_error` turns any of it into one ValueError.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

from .errors import exhausted_resource, first_line
from .files import read_json

# The checkpoint files transformers reads, whole or sharded (with their index); anything else it ignores.
READABLE_CHECKPOINTS = ("model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors",
                        "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin")
# Files that hold weights in formats transformers does not read (TensorFlow, Flax, raw PyTorch, GGUF in a folder).
OTHER_CHECKPOINTS = ("*.safetensors", "*.bin", "*.h5", "*.msgpack", "*.ckpt*", "*.pt", "*.pth", "*.gguf", "*.onnx")


def load_error(error: Exception, message: str) -> Exception:
    """What to raise for `error`, met while reading someone else's files: a resource that ran out, or an OSError of the
    machine (one with an errno: a file that cannot be read), as it is; anything else a ValueError of `message`."""
    if exhausted_resource(error) is not None or (isinstance(error, OSError) and error.errno is not None):
        return error
    return ValueError(message)


def remote_code(folder: Path) -> str | None:
    """Why `folder` cannot load without running code it ships, or None: a config.json whose model type transformers
    does not have, or has as no causal LM while the folder maps a causal LM class of its own, or a
    tokenizer_config.json whose tokenizer class transformers does not have, mapped to classes of the folder's own
    (`auto_map`). A known type with an `auto_map` beside it loads with transformers' own class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def known_model(value: str, auto_map: Any) -> bool:
        own_causal_lm = isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map
        return value in CONFIG_MAPPING and (value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not own_causal_lm)

    for name, key, known in (("config.json", "model_type", known_model),
                             ("tokenizer_config.json", "tokenizer_class", lambda v, _: tokenizer_class_from_name(v))):
        path = folder / name
        data = read_json(path, "model file") if path.is_file() else None
        if not isinstance(data, dict) or not data.get("auto_map"):
            continue
        value = data.get(key)
        if value is None or (isinstance(value, str) and known(value, data["auto_map"])):
            continue
        return (f"{str(path)!r} names remote code ({key} {value!r}, from {', '.join(_classes(data['auto_map']))}), "
                "which skipsearch never runs: use a model whose architecture transformers has")
    return None


def _classes(auto_map: Any) -> list[str]:
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return sorted({v for v in flat if isinstance(v, str)}) or ["auto_map"]


def unreadable_checkpoint(folder: Path) -> str | None:
    """Why `folder` holds no checkpoint transformers reads, or None: weights in another format are named."""
    if any(any(folder.glob(pattern)) for pattern in READABLE_CHECKPOINTS):
        return None
    others = sorted({path.name for pattern in OTHER_CHECKPOINTS for path in folder.glob(pattern)})
    if not others:
        return (f"model folder {str(folder)!r} has a config.json but no weights (*.safetensors or *.bin): "
                "`profile --config-only` builds it with random weights")
    return (f"model folder {str(folder)!r} has no checkpoint transformers reads (model.safetensors or "
            f"pytorch_model.bin, whole or sharded), only {', '.join(others[:4])}: convert it to safetensors")


def checkpoint_refusal(folder: Path, error: Exception) -> str:
    """What failed when `folder`'s weights would not load (a local folder, or a Hub name whose files are not named
    here): a pickled checkpoint (.bin) that torch refused to unpickle as weights only, named with what it would have
    called, else the error's first line. In a local folder without safetensors, each checkpoint .bin is unpickled
    again to name the file, weights only: nothing in it runs."""
    import torch

    refused = _unpickling_error(error)
    if not folder.is_dir():
        return (f"its pickled checkpoint was refused: {_unpickling_reason(refused)}" if refused is not None
                else f"cannot load its weights ({first_line(error)})")
    if not any(folder.glob("*.safetensors")):
        for path in sorted({p for pattern in READABLE_CHECKPOINTS if pattern.endswith(".bin")
                            for p in folder.glob(pattern)}):  # not training_args.bin and the like
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as unpickled:
                return f"checkpoint {str(path)!r} was refused: {_unpickling_reason(unpickled)}"
            except Exception as unreadable:  # noqa: BLE001 - torch's zip reader raises RuntimeError, and others
                return f"checkpoint {str(path)!r} is not a PyTorch checkpoint torch can read ({first_line(unreadable)})"
    return f"cannot load the weights in {str(folder)!r} ({first_line(error)})"


def _unpickling_error(error: BaseException | None) -> pickle.UnpicklingError | None:
    """torch's weights-only refusal in `error`'s chain (raised as it is, or wrapped by transformers), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, pickle.UnpicklingError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _unpickling_reason(error: pickle.UnpicklingError) -> str:
    """torch's weights-only refusal in words: the global the pickle would have called, or the unpickler's complaint
    (not torch's first line, which advises loading the file unsafely: skipsearch never does)."""
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return (f"it is a pickle that would call {found.group(1)} when loaded; skipsearch unpickles weights only, "
                "so nothing in it ran: use a safetensors checkpoint from a source you trust")
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    return (f"it does not unpickle as weights only ({detail.group(1).strip() if detail else 'not a pickle of weights'}"
            "), so nothing in it ran")


def tokenizer_refusal(folder: Path, error: Exception) -> str:
    """Why the tokenizer in `folder` would not load: a tokenizer.json that does not parse as a tokenizer is named
    (transformers reports a key it missed), else the tokenizer files there and the error's first line."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if path.is_file():
        try:
            Tokenizer.from_file(str(path))
        except Exception as unparsed:  # noqa: BLE001 - the Rust parser raises a bare Exception
            return f"tokenizer file {str(path)!r} does not parse as a tokenizer ({first_line(unparsed)})"
    files = sorted(p.name for p in folder.glob("*") if p.name.startswith(("tokenizer", "vocab", "merges", "special")))
    return (f"cannot load the tokenizer in {str(folder)!r} (files: {', '.join(files) or 'none'}): "
            f"{first_line(error)}")


def template_source(tokenizer: Any) -> str:
    """The file the tokenizer's chat template was read from, as well as it can be told, else its folder or name."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return str(folder)


def template_refusal(tokenizer: Any, error: Exception) -> str:
    """The one line for a chat template that jinja's sandbox stopped, or that does not parse or render."""
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    what = ("reaches for what jinja's sandbox forbids" if isinstance(error, SecurityError) else
            "does not parse" if isinstance(error, TemplateSyntaxError) else "fails to render")
    return (f"the chat template in {template_source(tokenizer)!r} {what} ({first_line(error)}): it was not run "
            "outside the sandbox; fix the template, or give --raw (raw=True) to skip it")
