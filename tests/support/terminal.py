"""A command in a real pseudo-terminal, as a user runs it: the pty is its controlling terminal
(Ctrl-C typed there is SIGINT to it, closing it hangs it up), and its output is read as it
comes, so it never blocks on a full terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import termios
import threading
import time
from pathlib import Path

from tests.support.processes import Processes


def _in_terminal() -> None:
    """In the child, before exec: stdin (the pty's slave side) becomes the controlling
    terminal of its new session, and SIGINT does what it does in a user's terminal, whatever
    pytest was started from (a shell without job control starts background commands with
    SIGINT ignored, and exec keeps that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`argv` on the slave side of a pty; we hold the master. The process is one of
    `processes` (stopped by PID at teardown); its output is kept and copied to `log_path`."""

    def __init__(
        self,
        processes: Processes,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path | None = None,
    ) -> None:
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=_in_terminal,
        )
        processes.started.append(self.process)
        os.close(slave)
        self.output = bytearray()
        self.closing = threading.Event()
        self.reader = threading.Thread(target=self._copy, args=(log_path,), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def _copy(self, log_path: Path) -> None:
        with log_path.open("ab") as log:
            while not self.closing.is_set():
                if select.select([self.master], [], [], 0.1)[0]:
                    try:
                        chunk = os.read(self.master, 65536)
                    except OSError:  # EIO: no process has the terminal open any more
                        return
                    if not chunk:
                        return
                    self.output.extend(chunk)
                    log.write(chunk)
                    log.flush()

    def type(self, keys: bytes) -> None:
        """As typed at the keyboard: b"\\x03" is Ctrl-C, SIGINT to the foreground command."""
        os.write(self.master, keys)

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.text)) is None:
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.text!r}"
            assert self.reader.is_alive(), f"closed before {pattern!r}: {self.text!r}"
            time.sleep(0.05)
        return match

    def wait(self, timeout_s: float) -> int:
        """The command's exit code, once its output is read to the end."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s}s: {self.text!r}") from None
        self.reader.join(timeout=timeout_s)
        return code

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """As when its window is closed: the session leader gets SIGHUP, writes get EIO."""
        if self.closing.is_set():
            return
        self.closing.set()
        self.reader.join(timeout=2)
        os.close(self.master)
