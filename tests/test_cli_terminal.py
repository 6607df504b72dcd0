"""`exo-tasks submit` in a real pseudo-terminal, as a user runs it: Ctrl-C (the terminal's own
SIGINT to the command) cancels the job, and `-q` ends its progress bar's line before the text."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.processes import EXO_TASKS, Processes, exo_env
from tests.support.stack import Stack, wait_tokens
from tests.support.terminal import Terminal


def run(processes: Processes, stack: Stack, tmp_path: Path, *args: str) -> Terminal:
    """`exo-tasks *args` against the stack's API, in a terminal of its own."""
    env = exo_env(api_url=stack.api.url)
    return Terminal(processes, [EXO_TASKS, *args], env, tmp_path / "terminal.log")


@pytest.mark.parametrize("quiet", [False, True], ids=["tokens", "quiet"])
def test_ctrl_c_during_submit_cancels_the_job(
    stack: Stack, processes: Processes, tmp_path: Path, quiet: bool
) -> None:
    args = ["submit", "long", "--max-tokens", "4000", "--ignore-eos", *(["-q"] if quiet else [])]
    with run(processes, stack, tmp_path, *args) as term:
        job_id = term.expect(r"job ([0-9a-f]{32})\r\n", 30).group(1)
        wait_tokens(stack, job_id)
        term.expect(r"tokens" if quiet else r"job [0-9a-f]{32}\r\n.", 10)

        term.type(b"\x03")  # Ctrl-C: the terminal sends SIGINT to the command
        interrupted = time.monotonic()
        assert term.wait(10) == 130
        assert time.monotonic() - interrupted < 5
        assert f"\r\ncancelled job {job_id}\r\n" in term.text
        assert "Traceback" not in term.text and "KeyboardInterrupt" not in term.text
        job = stack.api.wait_job(job_id, timeout_s=5)
        assert job["status"] == "cancelled" and 0 < job["usage"]["completion_tokens"] < 4000


def test_submit_quiet_ends_its_bar_before_the_text(
    stack: Stack, processes: Processes, tmp_path: Path
) -> None:
    with run(processes, stack, tmp_path, "submit", "hello", "--max-tokens", "16", "-q") as term:
        assert term.wait(60) == 0, term.text
        job_id = re.search(r"job ([0-9a-f]{32})", term.text)
        assert job_id is not None
        text = stack.api.get(f"/v1/jobs/{job_id.group(1)}").json()["output"]["text"]
        # The terminal shows "\n" as "\r\n"; the bar's line ends, and the text starts a line.
        shown = text.replace("\n", "\r\n")
        assert f"] 16/16 tokens\r\n{shown}\r\n[succeeded: length]\r\n" in term.text
