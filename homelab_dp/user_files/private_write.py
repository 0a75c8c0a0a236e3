"""A file written whole (atomically, private where it is the user's own) and a JSON file read
back tolerantly: the one way every per-user and run-folder file is written and re-read.

`replacing` writes through a temporary name in the same folder (``.NAME.PID.tmp``) and renames
it over the path, so a reader sees the old file or the new one, never half of one; a write that
fails (a full disk, an exception in the writer) leaves the old file as it was and nothing at the
temporary name, and its OSError names the path, not the temporary. Whatever sat at the
temporary name (a FIFO, a symlink, a torn write) is removed first and the name is created
exclusively without following a link, so it can neither make the write wait nor land elsewhere.
`write_whole` is it for bytes in hand, `write_private` for a file of the user's own (0600 in a
folder made 0700, `paths.ensure_private_dir`).

`read_back` reads a JSON file that may be missing or damaged (a cache, a calibration): a
regular file of bounded size only (`homelab_dp.safe_files.read_json`), and every failure is a
`ReadBack` with its reason, never an exception. Pure standard library.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from homelab_dp import safe_files
from homelab_dp.user_files.paths import ensure_private_dir

SHARED_MODE = 0o666
"""The mode of a file anyone may read, before the umask (what ``open`` gives a new file)."""
PRIVATE_MODE = 0o600


def temporary_name(path: Path) -> Path:
    """Where `replacing` writes ``path`` before the rename: hidden, this process's own."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def replacing(
    path: Path | str, *, mode: int = SHARED_MODE, fsync: bool = False
) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into; renamed over ``path`` when the block
    ends without an exception (``fsync``: flushed to the disk first), removed when it raises.
    ``mode``: the new file's permissions (the umask applies). The folder must exist."""
    path = Path(path)
    tmp = temporary_name(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        tmp.unlink(missing_ok=True)  # whatever sat there: a FIFO, a link, a torn write
        with os.fdopen(os.open(tmp, flags, mode), "wb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):
            exc.filename = str(path)  # the user's file, not a hidden temporary
        raise


def write_whole(
    path: Path | str, data: bytes | str, *, mode: int = SHARED_MODE, fsync: bool = False
) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (`replacing`); returns the path."""
    with replacing(path, mode=mode, fsync=fsync) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_private(path: Path | str, data: bytes | str, mode: int = PRIVATE_MODE) -> Path:
    """Write ``data`` to ``path`` atomically, the file ``mode`` (0600: the user's alone), its
    missing folders made 0700. Raises OSError (the old file kept, nothing at the temporary)."""
    ensure_private_dir(Path(path).parent)
    return write_whole(path, data, mode=mode)


@dataclass(frozen=True)
class ReadBack:
    """What `read_back` found: the document, or why there is none."""

    doc: Any = None
    """The JSON value read (None when the file is missing or unreadable)."""
    found: bool = False
    """Whether a file was read (a missing file is no problem: nothing was written yet)."""
    problem: str | None = None
    """Why the file that is there could not be read (not a regular file, over the bound, not
    UTF-8, not JSON), in a few words; None when it was read or is missing."""


def read_back(path: Path | str, limit: int) -> ReadBack:
    """The JSON document at ``path`` (a regular file of at most ``limit`` bytes), tolerantly:
    a missing file is an empty `ReadBack`, an unreadable or damaged one a `ReadBack` with its
    ``problem``; never an exception."""
    try:
        return ReadBack(safe_files.read_json(path, limit), True)
    except FileNotFoundError:
        return ReadBack()
    except (OSError, ValueError) as exc:
        return ReadBack(problem=str(exc))
