"""How a command runs in the process: SIGTERM as Ctrl-C, a console that cannot fail on what it prints, and an error
that ends a command as one line with its exit code."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from ..io.errors import RESOURCE_EXIT, exhausted_resource, resource_error
from ..io.files import home_folder

INTERRUPTED = 130  # the exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it) or SIGTERM


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM, which batch schedulers (Slurm, Kubernetes) send before they kill, raises KeyboardInterrupt as Ctrl-C
    does, instead of ending the process at once and silently: a study's trials and confirmation handle both signals
    themselves (worker.py's `stop_on_signals`), anything else ends in "interrupted". Handlers can only be set in the
    main thread: elsewhere SIGTERM keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def console_that_cannot_fail() -> Iterator[None]:
    """stdout and stderr that replace what their encoding cannot show (a non-ASCII prompt or folder name under
    `LC_ALL=C PYTHONIOENCODING=ascii`) instead of raising: the error would come after the work is done, lose the
    summary, and exit 2 as if the input were bad. Files are UTF-8 whatever the locale (files.py)."""
    changed = [stream for stream in (sys.stdout, sys.stderr)
               if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure")]
    for stream in changed:
        stream.reconfigure(errors="replace")
    try:
        yield
    finally:
        for stream in changed:
            stream.reconfigure(errors="strict")


@contextlib.contextmanager
def resource_errors_quiet_in_threads() -> Iterator[None]:
    """Optuna's heartbeat thread writes the study's storage too: on a full disk its write fails there as well, and
    Python would print that thread's traceback beside the one line that the main thread's error gets."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if exhausted_resource(args.exc_value) is None:
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def run(args: argparse.Namespace) -> int:
    try:
        home_folder()  # before transformers, datasets and matplotlib derive their caches from HOME
    except ValueError as error:
        return fail(args, error, 2)
    # The CLI prints its own progress; transformers' weight-loading bars would bury the one-line errors.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # per-trial INFO lines would drown the progress bar
    try:
        with sigterm_as_ctrl_c(), resource_errors_quiet_in_threads():
            return args.run(args)
    except KeyboardInterrupt:
        print(f"{args.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:
        return report(args, error)


def report(args: argparse.Namespace, error: Exception) -> int:
    """One line on stderr for an error that ends a command, and its exit code: a resource that ran out (disk space, a
    file-size limit, memory) RESOURCE_EXIT, bad input 2, another fault of the machine (an OSError) 1. Anything else
    is a bug, and keeps its traceback."""
    found = exhausted_resource(error)
    if found is not None:
        filename = getattr(found[1], "filename", None)
        doing = f"writing {str(filename)!r}" if filename else f"`{args.command}`"
        return fail(args, resource_error(error, doing, "free some and run the command again"), RESOURCE_EXIT)
    if isinstance(error, ValueError):
        return fail(args, error, 2)
    if isinstance(error, OSError) and error.strerror:
        return fail(args, error.strerror + (f": {error.filename}" if error.filename else ""), 1)
    raise error


def fail(args: argparse.Namespace, message: object, code: int) -> int:
    """Print `message` as the command's one error line, the storage URL's secrets redacted; return `code`."""
    from ..search.storage import redact_text  # here: it imports optuna, which --help does without

    print(f"{args.prog}: error: {redact_text(str(message), getattr(args, 'storage', None))}", file=sys.stderr)
    return code
