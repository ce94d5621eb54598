"""Files that hold secrets (tokens, keys, credentials): created whole with mode 0600, and trusted only when
this user owns them and nobody else may read or write them.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from config import ConfigError


class SecretFileError(ConfigError):
    """A secret-bearing file cannot be created, read or trusted; the message names the path and the fix."""


def check_private(path: Path, info: os.stat_result, what: str) -> None:
    """SecretFileError unless `path` (its `info`) belongs to this user and nobody else may read or write it."""
    if info.st_uid != os.getuid():
        raise SecretFileError(f"{path} ({what}) belongs to another user (uid {info.st_uid}), so it may have been "
                              "planted: delete it, or run as its owner")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise SecretFileError(f"{path} ({what}) is readable or writable by other users: run chmod 600 {path}")


def read_secret_file(path: Path, what: str = "a secret") -> bytes:
    """The contents of a secret-bearing file; SecretFileError (path and fix) when it is missing, a link, not
    this user's, or group/world-readable. The one reader of token, key and credential files."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise SecretFileError(f"{path} ({what}) does not exist") from None
    except OSError as exc:
        raise SecretFileError(f"cannot read {path} ({what}: {exc.strerror}): run as the user who runs the "
                              "server") from None
    with os.fdopen(fd, "rb") as fh:
        check_private(path, os.fstat(fh.fileno()), what)
        return fh.read()


def ensure_secret_file(path: Path, make: Callable[[], bytes], what: str = "a secret") -> tuple[bytes, bool]:
    """The contents of `path`, written first from `make()` (mode 0600) when it is missing: (contents, whether
    it was created now). The file appears whole or not at all (written aside, then linked into place), so
    two processes starting at once read the same one. SecretFileError as `read_secret_file`."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            return read_secret_file(path, what), False
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")  # mkstemp: 0600
    except OSError as exc:
        raise SecretFileError(f"cannot create {path} ({what}: {exc.strerror}): make {path.parent} a directory "
                              "this user can write, or set AGENT_DATA_DIR to one") from None
    try:
        data = make()
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)  # fails if another process created it meanwhile: theirs is the one
    except FileExistsError:
        return read_secret_file(path, what), False
    finally:
        Path(tmp).unlink(missing_ok=True)
    return data, True


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once, mode 0600 whatever the umask (data dir files, head files)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")  # mkstemp: 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
