"""Errors as the command line reports them: one line, no traceback."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
