"""A long prompt is work, not a hang: its prefill runs in chunks, each progress for the stall
watchdog, so a prefill longer than EXO_PREFILL_TIMEOUT_S succeeds; a runner that truly hangs in
prefill is still stopped. The limit is set low here (2 s): what matters is the ratio."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack, new_worker
from tests.support.workers import runner_state, wait_runner

PREFILL_TIMEOUT_S = 2
# About 7,900 tokens with the tiny model's character tokenizer (the cap is 8,192): 3-10 s of
# prefill on 2 cores, in steps of at most 0.3-0.6 s (a step's cost grows along the prompt): the
# limit is passed, each step well within it even when other processes share the cores.
LONG_PROMPT = "the quick brown fox jumps over the lazy dog. " * 175


def test_a_prefill_longer_than_the_stall_limit_succeeds_beside_another_job(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "lp-busy", prefill_timeout_s=2)
    pid = runner_state(stack.store, "lp-busy").pid
    long_job = stack.api.submit(prompt=LONG_PROMPT, max_tokens=2, host="lp-busy")
    other = stack.api.submit(prompt="hello", max_tokens=16, ignore_eos=True, host="lp-busy")
    done = stack.api.wait_job(long_job, timeout_s=120)
    assert done["status"] == "succeeded", done
    assert done["usage"]["prompt_tokens"] > 7500
    prefill_s = done["timings"]["ttft_ms"] / 1000  # from its start on the runner
    assert prefill_s > 1.25 * PREFILL_TIMEOUT_S, f"prefill took only {prefill_s:.1f}s: too short"
    assert stack.api.wait_job(other)["status"] == "succeeded"
    state = runner_state(stack.store, "lp-busy")
    assert state.pid == pid and state.status.accepts_jobs, state


def test_a_runner_stopped_in_prefill_is_still_failed_as_stalled(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "lp-hung", prefill_timeout_s=2)
    pid = runner_state(stack.store, "lp-hung").pid
    assert pid is not None
    job_id = stack.api.submit(prompt=LONG_PROMPT, max_tokens=2, host="lp-hung")
    # The job is `running` once handed to the runner's inbox; the runner holds it (the stall
    # watchdog sees a job awaiting its first token) once it publishes Running with it.
    wait_until(
        lambda: (
            (state := runner_state(stack.store, "lp-hung")).active_jobs == 1
            and state.status == "Running"
        ),
        30,
        "the runner to take the job",
    )
    assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
    os.kill(pid, signal.SIGSTOP)  # in prefill: the prompt takes seconds, it just started
    hung = time.monotonic()
    job = stack.api.wait_job(job_id, timeout_s=PREFILL_TIMEOUT_S + 5)
    assert time.monotonic() - hung < PREFILL_TIMEOUT_S + 3
    assert job["status"] == "failed" and "stalled in prefill" in job["error"], job
    state = wait_runner(stack.store, "lp-hung", "Failed", 10)
    assert state.error is not None and state.error.startswith("stalled in prefill")
    assert wait_runner(stack.store, "lp-hung", "Ready", 60).pid != pid
