"""Errors as the command line reports them: one line, no traceback. What counts as a resource running out (disk space,
a file-size limit, memory) is decided here, once, for every command and the study's trials."""

from __future__ import annotations

import errno
import sys

# The exit code of a command stopped because the machine ran out of something (2 is bad input, 130 a stop signal):
# a scheduler can tell "free space or memory and run it again" from a mistake in the command.
RESOURCE_EXIT = 3


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class ResourceExhausted(RuntimeError):
    """The machine ran out of something a command needs (disk space, a file-size limit, memory), found before the work
    or during it: not bad input, and no use retrying until it is freed. The CLI prints it in one line and exits
    `RESOURCE_EXIT`; a study's trials end at once on it instead of failing one after another."""


class NonFiniteLogits(ValueError):
    """A model whose logits hold NaN or inf (damaged weights, or an overflow in its dtype): every figure computed from
    them would be meaningless, so decoding refuses at the first forward."""


# errno of a write that found no room, and what ran out, as the one-line errors name it.
_ERRNO_RESOURCES = {errno.ENOSPC: "disk space", errno.EDQUOT: "disk quota",
                    errno.EFBIG: "room under the file-size limit"}
# The same in words, for errors that carry only text: SQLite's (it reports EFBIG as a "disk I/O error"), the
# allocators' (PyTorch's CPU allocator raises a RuntimeError, CUDA's an OutOfMemoryError).
_TEXT_RESOURCES = (("database or disk is full", "disk space"), ("no space left on device", "disk space"),
                   ("disk quota exceeded", "disk quota"), ("file too large", "room under the file-size limit"),
                   ("disk i/o error", "disk space or room under the file-size limit"),
                   ("can't allocate memory", "memory"), ("out of memory", "memory"),
                   ("not enough memory", "memory"))


def exhausted_resource(error: BaseException | None) -> tuple[str, BaseException] | None:
    """What ran out according to `error` or an error it came from (its cause, context, or a SQLAlchemy error's
    `orig`), and that error; None when nothing did. Only errors of the machine are read (OSError, MemoryError, the
    drivers' and allocators' errors): a ValueError that merely mentions "no space" is a message, not a fault."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ResourceExhausted):
            return "resource", error
        if isinstance(error, MemoryError):
            return "memory", error
        if isinstance(error, OSError) and error.errno in _ERRNO_RESOURCES:
            return _ERRNO_RESOURCES[error.errno], error
        if _machine_error(error):
            text = str(error).lower()
            found = next((resource for words, resource in _TEXT_RESOURCES if words in text), None)
            if found is not None:
                return found, error
        error = error.__cause__ or error.__context__ or getattr(error, "orig", None)
    return None


def _machine_error(error: BaseException) -> bool:
    """Errors whose text can say that a resource ran out: OSError, SQLite's and SQLAlchemy's, PyTorch's RuntimeError."""
    if isinstance(error, (OSError, RuntimeError)):
        return True
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is not None and isinstance(error, sqlite3.Error):
        return True
    sqlalchemy = sys.modules.get("sqlalchemy.exc")
    return sqlalchemy is not None and isinstance(error, sqlalchemy.DBAPIError)


def resource_error(error: BaseException, doing: str, advice: str = "") -> ResourceExhausted | None:
    """`error` as a ResourceExhausted of one line that names what ran out and what was being done (`doing`, e.g.
    "writing study database 'studies/x.db'"), or None when `error` is not about a resource. One already made is
    kept as it is: the innermost place named its file."""
    found = exhausted_resource(error)
    if found is None:
        return None
    resource, cause = found
    if isinstance(cause, ResourceExhausted):
        return cause
    driver = getattr(cause, "orig", None) or cause  # SQLAlchemy's message repeats the driver's after its class name
    detail = driver.strerror if isinstance(driver, OSError) and driver.strerror else first_line(driver)
    return ResourceExhausted(f"out of {resource}: {doing} failed ({detail})" + (f"; {advice}" if advice else ""))
