"""Files that readers never see half-written, with the mode a plain write would give, and JSON reads whose errors
name the file. Every output skipsearch writes (configs, profiles, bench results, plots) goes through here: a regular
file is replaced atomically, a stream (a character device, a FIFO, a path that names a file descriptor) written
through, never replaced."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
import types
from typing import Any, Union, get_args, get_origin

from .errors import ResourceExhausted, resource_error


def follow_umask(path: str | Path) -> None:
    """Give a file from mkstemp (0600) or a folder from mkdtemp (0700) the mode open() / mkdir() would give:
    0666 / 0777 less the umask, so that renamed-into-place outputs are as readable as any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def _replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Let `write` fill a temp file beside `path`, then rename it over `path`: readers see the old file or the new
    one, never a part, and a failed write leaves nothing behind. For regular files only: `write_output` decides."""
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


# A path that names a file descriptor rather than a file: /dev/fd/N, /proc/<pid or self>/fd/N (and a thread's), once
# the folders above it are resolved (/dev/fd is a link to /proc/self/fd, /proc/self one to /proc/<pid>).
_DESCRIPTOR_PATH = re.compile(r"/(?:dev/fd|proc/(self|thread-self|\d+)(?:/task/\d+)?/fd)/(\d+)")
_STANDARD_STREAMS = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}


def named_descriptor(path: str | Path) -> tuple[bool, int | None]:
    """Whether `path` names a stream by its file descriptor, and which of this process's descriptors (None: another
    process's): /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N, /proc/<pid>/fd/N, a symlink to one of them, or
    a path that is the same file as standard output or error. Such a path resolves to whatever the descriptor is open
    on, a regular file too (`> log.txt`): replacing that file would wipe what the caller wrote there before."""
    current = os.path.abspath(path)
    for _ in range(40):  # Linux's own limit on links followed: a loop of links ends here
        current = os.path.join(os.path.realpath(os.path.dirname(current)), os.path.basename(current))
        if current in _STANDARD_STREAMS:
            return True, _STANDARD_STREAMS[current]
        match = _DESCRIPTOR_PATH.fullmatch(current)
        if match:
            owner = match.group(1)
            own = owner is None or not owner.isdigit() or int(owner) == os.getpid()
            return True, int(match.group(2)) if own else None
        if not os.path.islink(current):
            break
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    try:
        named = os.stat(path)
    except OSError:
        return False, None
    for descriptor in (1, 2):  # the file itself, as `--output log.txt > log.txt` names it
        try:
            if os.path.samestat(named, os.fstat(descriptor)):
                return True, descriptor
        except OSError:  # that descriptor is closed
            continue
    return False, None


def output_target(path: str | Path) -> tuple[Path, bool]:
    """Where an output named `path` goes, and whether it is written through instead of replaced.

    A regular file (or a new one) is replaced atomically; a symlink to one replaces its target, so the link stays.
    A character device or a FIFO (/dev/null, a named pipe), or a symlink to one, is a stream: renaming over it would
    replace the entry itself (as root, /dev/stdout's) and send nothing down the stream, so it is written through. So
    is a path that names a file descriptor (`named_descriptor`), whatever it is open on. Anything else (a block
    device, a socket, a folder) is refused with a ValueError of one line."""
    path = Path(path)
    descriptor, own = named_descriptor(path)
    if descriptor:
        try:
            os.fstat(own) if own is not None else os.stat(path)
        except OSError:
            raise ValueError(f"{str(path)!r} names a file descriptor that is not open") from None
        return path, True
    try:
        mode = os.stat(path).st_mode  # follows symlinks: the kind of what is written to
    except (FileNotFoundError, NotADirectoryError):  # a new file (a dangling link: its target); its folder is checked
        return (path.resolve() if path.is_symlink() else path), False  # where it is made
    if stat.S_ISREG(mode):
        return path.resolve() if path.is_symlink() else path, False
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return path, True
    kind = "a folder" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket" \
        if stat.S_ISSOCK(mode) else "not a regular file"
    raise ValueError(f"{str(path)!r} is {kind}: name a file, a character device or a FIFO")


def _open_stream(target: Path, descriptor: int | None):
    """A binary file to write an output through to a stream. This process's own descriptor is duplicated and written
    at its position, after what was printed before (flushed first), as the shell's `(echo; command; echo) > log`
    expects of it; another path is opened to append: a device or a FIFO has no position, and a file reached through
    another process's descriptor keeps what it holds."""
    if descriptor is None:
        return open(target, "ab")
    for printed in (sys.stdout, sys.stderr):
        if printed is not None and not printed.closed:
            printed.flush()
    return os.fdopen(os.dup(descriptor), "wb")  # "wb" on a descriptor already open truncates nothing


def write_output(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write an output at `path` through `write` (which fills the file it is given), as `output_target` decides:
    replaced atomically, or written through to a stream (whole, from a temp file: a failed `write` sends nothing).
    A disk or a file-size limit that runs out is a ResourceExhausted naming `path`."""
    target, stream = output_target(path)
    try:
        if not stream:
            _replace_atomically(target, write)
            return
        with tempfile.TemporaryDirectory() as folder:
            staged = Path(folder) / Path(path).name
            write(staged)
            with staged.open("rb") as source, _open_stream(target, named_descriptor(path)[1]) as sink:
                shutil.copyfileobj(source, sink)
    except OSError as error:
        exhausted = resource_error(error, f"writing {str(path)!r}")
        if exhausted is not None:
            raise exhausted from None
        raise


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` as UTF-8 so that readers see the old file or the new one, never a part (a stream gets
    the text whole: `write_output`)."""
    write_output(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def home_folder() -> Path:
    """The home folder that caches (~/.cache) are made in: $HOME, or the password database's entry when HOME is unset
    (as Path.home()). A HOME set empty or relative is a ValueError: Path.home() would give "/" or the working folder,
    and a 500 MB model would be cached at the file system's root, or wherever the command happens to run."""
    home = os.environ.get("HOME")
    if home is None:
        return Path.home()
    if not os.path.isabs(home):
        where = "at the root of the file system" if not home else "in whatever folder the command runs in"
        raise ValueError(f"HOME is {'empty' if not home else f'relative ({home!r})'}: the caches kept under ~/.cache "
                         f"(skipsearch's converted models, Hugging Face's, matplotlib's) would be made {where}; set "
                         "HOME to your home folder, or unset it")
    return Path(home)


# errno of a path that names no file to read: the input's fault. Any other errno (permissions, an I/O error) is the
# machine's, and stays an OSError: the CLI names it and its file, exit 1 (a resource that ran out, exit 3).
_NO_FILE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG})


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts; a zombie, killed and not yet reaped, not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_json(path: str | Path, what: str, lines: bool = False) -> Any:
    """A JSON file's content, or with `lines` a JSON Lines file's: a list of (line number, value), blank lines
    left out. A missing, malformed or hostile file (nested past Python's recursion limit) is a ValueError of one line
    that names `what`, the file and, in JSON Lines, the line; a file the machine cannot read (permissions, an I/O
    error) an OSError, as it was raised."""
    name = repr(str(path))
    if Path(path).is_dir():
        raise ValueError(f"{what} {name} is a folder: give a file")
    try:
        # utf-8-sig: a byte-order mark, which Windows editors put at the start, is dropped (json refuses it).
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"{what} {name} does not exist") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {name} is not UTF-8 text (at byte {error.start}): save it as UTF-8") from None
    except OSError as error:
        if error.errno is not None and error.errno not in _NO_FILE_ERRNOS:
            raise
        raise ValueError(f"cannot read {what} {name}: {error.strerror or error}") from None
    if not lines:
        return _parse_json(text, f"{what} {name}")
    # JSON Lines ends a line at "\n" alone: splitlines() would also split at U+2028, U+0085 and others, which
    # json.dumps(ensure_ascii=False) leaves as they are inside strings, and cut a valid row in two.
    return [(number, _parse_json(line, f"{what} {name}, line {number}"))
            for number, line in enumerate((line.removesuffix("\r") for line in text.split("\n")), start=1)
            if line.strip()]


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: {_json_fault(text, error)}") from None
    except RecursionError:  # json's C decoder recurses once per level: a hostile or damaged file
        raise ValueError(f"{where}: nested too deeply to read (over {sys.getrecursionlimit()} levels of arrays or "
                         "objects; damaged, or not the file meant)") from None


def _json_fault(text: str, error: json.JSONDecodeError) -> str:
    """What is wrong with a JSON text, and where: a column for one line, a line and column for more, and a text that
    ends inside a value (a string never closed, or the end where a value should come) said to be cut short, since its
    error's line is wherever a last newline put it."""
    if not text.strip():
        return "empty, not JSON"
    message = error.msg.removesuffix(" starting at")  # an unclosed string's message ends in "at" already
    if error.msg.startswith("Unterminated string") or error.pos >= len(text.rstrip()):
        return f"not valid JSON ({message} at its end: cut short?)"
    place = f"column {error.colno}" if "\n" not in text.strip() else f"line {error.lineno} column {error.colno}"
    return f"not valid JSON ({message} at {place})"


def unwritable_folder(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made if missing), or None when they can; a ResourceExhausted when
    its device is full. Creates nothing."""
    existing = folder
    while not existing.exists():
        if existing.is_symlink() or existing.parent == existing:
            return f"{str(folder)!r} cannot be created"
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{str(existing)!r} is not writable"
    stats = os.statvfs(existing)
    if stats.f_flag & os.ST_RDONLY:
        return f"{str(existing)!r} is on a read-only file system"
    if stats.f_bavail * stats.f_frsize < _MIN_FREE_BYTES:  # the machine's fault, not the input's: its own exit code
        raise ResourceExhausted(f"out of disk space: no space left on the device of {str(existing)!r} (less than "
                                f"{_MIN_FREE_BYTES >> 20} MiB free); free some and run the command again")
    return None


_MIN_FREE_BYTES = 1 << 20


def check_output_file(path: Path, flag: str, inside: Path | None = None) -> None:
    """Before any work: `path` can be written as a file (it is not a folder; its folder can be made and written), or
    it is a stream this process may write (`output_target`: a character device, a FIFO, a file descriptor). `flag`
    names the option that gave it, in the one-line ValueError; `inside`: the folder it gave, which `path` is made in."""
    _check_given_folder(inside, flag)
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder: name a file")
    try:
        target, stream = output_target(path)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None
    problem = _unwritable_stream(path, target) if stream else unwritable_folder(target.parent)
    if problem:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {problem}")


def _unwritable_stream(path: Path, target: Path) -> str | None:
    """Why the stream `path` cannot be written, or None. This process's own descriptor is asked how it was opened:
    the file it is open on may be read-only to its name and still written through it."""
    descriptor = named_descriptor(path)[1]
    if descriptor is None:
        return None if os.access(target, os.W_OK) else "not writable"
    if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
        return None
    return f"file descriptor {descriptor} is open for reading only"


def _check_given_folder(folder: Path | None, flag: str) -> None:
    """The folder a flag gave, which an output is made in, refused by the name it was given where it is a file (the
    path made in it would be named otherwise: '<file>/bench', which nobody typed)."""
    if folder is not None and folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file: name a folder")


def check_output_folder(path: Path, flag: str, inside: Path | None = None) -> None:
    """Before any work: files can be written in folder `path` (made if missing); `inside`: the folder `flag` gave,
    which `path` is made in."""
    _check_given_folder(inside, flag)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file: name a folder")
    problem = unwritable_folder(path)
    if problem:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {problem}")


def json_matches(value: Any, hint: Any) -> bool:
    """Whether the JSON value `value` is of the type `hint` (a JSON number is a float; a bool is no number)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return any(json_matches(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(json_matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(json_matches(key, args[0]) and json_matches(item, args[1])
                                               for key, item in value.items())
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    return isinstance(value, (int, float)) if hint is float else isinstance(value, hint)


def json_type(hint: Any) -> str:
    """The type `hint` in the words of JSON: `float | None` is "a number", `list[str]` "a list of strings"."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(json_type(arg) for arg in args if arg is not type(None))
    if origin is list:
        return f"a list of {json_type(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "an object"
    return _JSON_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
               dict: "an object"}
