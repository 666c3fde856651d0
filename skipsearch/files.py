"""Files that readers never see half-written, with the mode a plain write would give, and JSON reads whose errors
name the file. Every output skipsearch writes (configs, profiles, bench results, plots) goes through here."""

from __future__ import annotations

import json
import os
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


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's content; a missing, unreadable or malformed file is a ValueError that names `what`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {what} {str(path)!r}: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {error}") from None
