"""Files that readers never see half-written, with the mode a plain write would give, and JSON reads whose errors
name the file. Every output skipsearch writes (configs, profiles, bench results, plots) goes through here."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def follow_umask(path: str | Path) -> None:
    """Give a file from mkstemp (0600) or a folder from mkdtemp (0700) the mode open() / mkdir() would give:
    0666 / 0777 less the umask, so that renamed-into-place outputs are as readable as any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Let `write` fill a temp file beside `path`, then rename it over `path`: readers see the old file or the new
    one, never a part, and a failed write leaves nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        follow_umask(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a part."""
    replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_json(path: str | Path, what: str, lines: bool = False) -> Any:
    """A JSON file's content, or with `lines` a JSON Lines file's: a list of (line number, value), blank lines
    left out. A missing, unreadable, malformed or hostile file (nested past Python's recursion limit) is a
    ValueError of one line that names `what`, the file and, in JSON Lines, the line."""
    name = repr(str(path))
    if Path(path).is_dir():
        raise ValueError(f"{what} {name} is a folder: give a file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {name} does not exist") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {name} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot read {what} {name}: {error.strerror or error}") from None
    if not lines:
        return _parse_json(text, f"{what} {name}")
    return [(number, _parse_json(line, f"{what} {name}, line {number}"))
            for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        place = f"column {error.colno}" if "\n" not in text.strip() else f"line {error.lineno} column {error.colno}"
        raise ValueError(f"{where}: not valid JSON ({error.msg} at {place})") from None
    except RecursionError:  # json's C decoder recurses once per level: a hostile or damaged file
        raise ValueError(f"{where}: nested too deeply to read (over {sys.getrecursionlimit()} levels of arrays or "
                         "objects; damaged, or not the file meant)") from None
