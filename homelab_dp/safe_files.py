"""Input that may be damaged or hostile: JSON text parsed without a traceback, a regular file
read only, never more than a bound.

Every reader of JSON from outside (data files, prompts, caches) goes through `parse`: whatever
the text holds, it returns a value or raises `BadJson` (a ValueError) with one short reason,
never a RecursionError (an array nested 100,000 deep) nor the int conversion limit's ValueError
(a 5,000-digit integer).

Caches and calibration files live in the user's folders, where anything may sit at their path:
an edited or torn file, a symlink to ``/dev/zero`` (endless bytes), a FIFO (an ``open`` that waits
for a writer forever), a file of gigabytes. `read_regular` opens the path without blocking
(``O_NONBLOCK``: a FIFO opens at once), checks on the opened descriptor that it is a regular file
(a symlink is followed to what it names, and that must be a regular file too) and no larger than
``limit``, and reads at most ``limit`` + 1 bytes, so a file that grows while it is read is caught
too. Every refusal is a `FileRefused`, an `OSError`: a caller that treats an unreadable file as
missing already handles it. `read_json` adds the UTF-8 decoding and `parse`.

Writing such a file whole and private is `homelab_dp.user_files.private_write`'s.

Pure standard library (the bottom layer).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MiB = 2**20
MAX_INT_DIGITS = 4300
"""The longest integer `parse` reads (Python's own conversion limit by default)."""


class BadJson(ValueError):
    """Text that is not JSON `parse` reads; ``reason`` says why in a few words (with the column
    where the decoder knows it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BadJson(f"an integer of {digits} digits, over the limit of {MAX_INT_DIGITS}")
    return int(text)


def _no_constant(name: str) -> Any:
    raise BadJson(f"{name} is not a JSON number")


def parse(text: str | bytes, *, constants: bool = True) -> Any:
    """The JSON value of ``text``, or `BadJson` naming what is wrong: not JSON (with the column),
    nested too deeply for the decoder, an integer over `MAX_INT_DIGITS` digits, or (with
    ``constants=False``) ``NaN``/``Infinity``. ``constants``: read those as floats (as `json`
    does; a data file's extra columns may hold them)."""
    try:
        if constants:
            return json.loads(text, parse_int=_bounded_int)
        return json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
    except BadJson:
        raise
    except json.JSONDecodeError as exc:
        raise BadJson(f"{exc.msg}, column {exc.colno}") from None
    except RecursionError:
        raise BadJson("nested too deeply") from None
    except ValueError as exc:  # a number the decoder cannot convert, bytes not UTF-8
        raise BadJson(str(exc).split(";")[0]) from None


class FileRefused(OSError):
    """A path that is not read: not a regular file, or over its size bound. ``strerror`` is the
    reason alone, ``filename`` the path."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(reason)
        self.strerror, self.filename = reason, str(path)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_regular(path: Path | str) -> int:
    """A read-only descriptor of ``path``, a regular file (symlinks followed); the caller closes
    it. Raises `FileRefused` for anything else (a FIFO, a device, a socket, a folder), and
    `OSError` when it cannot be opened (FileNotFoundError: missing)."""
    before = os.stat(path)  # a device is never even opened
    if not stat.S_ISREG(before.st_mode):
        raise FileRefused(path, f"not a regular file ({_kind(before.st_mode)})")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)  # what was opened: the path may have changed since the stat
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileRefused(path, f"not a regular file ({_kind(st.st_mode)})")
    return fd


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file (symlinks followed) of at most ``limit`` bytes.

    Raises `FileRefused` for anything else (a FIFO, a device, a socket, a folder, a file over
    ``limit``), and `OSError` when it cannot be opened or read (FileNotFoundError: missing)."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise FileRefused(path, f"{st.st_size} bytes, over the limit of {limit}")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(limit + 1 - got, 4 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise FileRefused(path, f"grew past the limit of {limit} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: Path | str, limit: int) -> Any:
    """`read_regular`, decoded as UTF-8 and parsed by `parse`.

    Raises `OSError` (`FileRefused` included) when the file cannot be read, and `ValueError`
    (UnicodeDecodeError, `BadJson`) when what it holds is not JSON."""
    return parse(read_regular(path, limit).decode("utf-8"))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a file"
