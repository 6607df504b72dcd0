"""`exo-tasks submit` in a real pseudo-terminal, as a user runs it: Ctrl-C (the terminal's own
SIGINT to the command) cancels the job, and `-q` ends its progress bar's line before the text."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.conftest import Stack, wait_tokens
from tests.support.processes import EXO_TASKS, exo_env, kill_tree


@dataclass
class Terminal:
    """A command on the slave side of a pty, as its controlling terminal; we hold the master."""

    pid: int
    fd: int
    output: bytearray = field(default_factory=bytearray)
    status: int | None = None

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def read(self, timeout_s: float) -> bool:
        """Read what is there within `timeout_s`; False once the command closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the slave side is closed
            return False
        self.output.extend(chunk)
        return bool(chunk)

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.text)) is None:
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.text!r}"
            assert self.read(0.1), f"closed before {pattern!r}: {self.text!r}"
        return match

    def wait(self, timeout_s: float) -> int:
        """The command's exit code, reading its output to the end."""
        deadline = time.monotonic() + timeout_s
        while self.read(0.1):
            assert time.monotonic() < deadline, f"still running: {self.text!r}"
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
            else:
                assert time.monotonic() < deadline, f"did not exit: {self.text!r}"
                time.sleep(0.05)
        return os.waitstatus_to_exitcode(self.status)

    def close(self) -> None:
        if self.status is None:
            kill_tree(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture
def terminal() -> Iterator[list[Terminal]]:
    """Run `exo-tasks` commands in terminals of their own; each is killed at teardown."""
    started: list[Terminal] = []
    yield started
    for term in started:
        term.close()


def run(started: list[Terminal], stack: Stack, *args: str) -> Terminal:
    env = exo_env(api_url=stack.api.url)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        try:
            # As in a user's terminal, whatever pytest was started from (a shell without job
            # control starts background commands with SIGINT ignored, and exec keeps that).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(EXO_TASKS, [EXO_TASKS, *args], env)
        finally:
            os._exit(127)
    started.append(Terminal(pid, fd))
    return started[-1]


@pytest.mark.parametrize("quiet", [False, True], ids=["tokens", "quiet"])
def test_ctrl_c_during_submit_cancels_the_job(
    stack: Stack, terminal: list[Terminal], quiet: bool
) -> None:
    args = ["submit", "long", "--max-tokens", "4000", "--ignore-eos", *(["-q"] if quiet else [])]
    term = run(terminal, stack, *args)
    job_id = term.expect(r"job ([0-9a-f]{32})\r\n", 30).group(1)
    wait_tokens(stack, job_id)
    term.expect(r"tokens" if quiet else r"job [0-9a-f]{32}\r\n.", 10)

    os.write(term.fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the command
    interrupted = time.monotonic()
    assert term.wait(10) == 130
    assert time.monotonic() - interrupted < 5
    assert f"\r\ncancelled job {job_id}\r\n" in term.text
    assert "Traceback" not in term.text and "KeyboardInterrupt" not in term.text
    job = stack.api.wait_job(job_id, timeout_s=5)
    assert job["status"] == "cancelled" and 0 < job["usage"]["completion_tokens"] < 4000


def test_submit_quiet_ends_its_bar_before_the_text(stack: Stack, terminal: list[Terminal]) -> None:
    term = run(terminal, stack, "submit", "hello", "--max-tokens", "16", "-q")
    assert term.wait(60) == 0, term.text
    job_id = re.search(r"job ([0-9a-f]{32})", term.text)
    assert job_id is not None
    text = stack.api.get(f"/v1/jobs/{job_id.group(1)}").json()["output"]["text"]
    # The terminal shows "\n" as "\r\n"; the bar's line ends, and the text starts a line.
    shown = text.replace("\n", "\r\n")
    assert f"] 16/16 tokens\r\n{shown}\r\n[succeeded: length]\r\n" in term.text
