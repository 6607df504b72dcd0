"""The embedded Redis's password: made at its first start, kept in a file only the stack's user
can read, and never on a command line (every local user sees those in `ps`). Its directory,
which also holds the AOF (every prompt and output), is the stack's user's alone."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

PASSWORD_FILE = "password"
CONF_FILE = "auth.conf"  # redis-server reads it with `--include`: the password off its argv


def redis_password(redis_dir: Path) -> str:
    """The password in `redis_dir`, made if missing. Every process of a stack starting at once
    gets the same one: it is written aside and linked into place, which only one can do."""
    path = redis_dir / PASSWORD_FILE
    private_dir(redis_dir)
    if not path.exists():
        draft = redis_dir / f".{PASSWORD_FILE}.{os.getpid()}"
        write_private(draft, secrets.token_urlsafe(32))
        with contextlib.suppress(FileExistsError):  # another process was first: use its
            os.link(draft, path)
        draft.unlink()
    return path.read_text().strip()


def redis_auth_conf(redis_dir: Path, password_dir: Path | None = None) -> Path:
    """A config file for redis-server in `redis_dir` that sets the password (`requirepass`) of
    `password_dir` (default: its own), and the same for reaching a master (`masterauth`): any
    server of an HA stack may be a replica after a failover."""
    password = redis_password(password_dir or redis_dir)
    path = redis_dir / CONF_FILE
    write_private(path, f"requirepass {password}\nmasterauth {password}\n")
    return path


def private_dir(path: Path) -> Path:
    """`path`, a directory only this user can enter (0700), made if missing; one made before
    with the umask's mode (0755) is closed too."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user alone from the first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        file.write(text)
