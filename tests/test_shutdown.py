"""Every way of stopping work is bounded, says why it stopped, and loses nothing.

Each test runs its own worker (its own host name, jobs pinned to it) on the session's Redis, and
breaks it with real signals.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from config.settings import Settings
from exo_tasks.celery_app import INFERENCE_TASK
from exo_tasks.commands import SubmitJob
from exo_tasks.naming import runner_id_for
from exo_tasks.types import JobRecord, JobRequest, JobStatus, utcnow
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, has_exited, wait_until
from tests.support.stack import LONG, Stack, new_worker, wait_tokens
from tests.support.workers import Worker, pool_children, runner_state, wait_runner

# A job still decoding when its worker stops (within the stop's own bound of 5 s, 2.5 s at the
# runner's fastest on an idle 2-core machine, ~500 tokens/s), then rerun in full after the
# restart: LONG's 4,000 tokens took 13-20 s to rerun on the loaded CI machine.
IN_FLIGHT = {**LONG, "max_tokens": 2500}


def report_margin(stack: Stack, job_id: str) -> None:
    """Print how far the job's first attempt got before its requeue: IN_FLIGHT's margin."""
    events = [event.event for _, event in stack.store.streams.read_events(job_id)]
    streamed = events[: events.index("requeued")].count("token")
    print(f"requeued after {streamed} of {IN_FLIGHT['max_tokens']} tokens")


def test_idle_warm_shutdown_is_done_within_2s_and_load_starts_it_again(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-idle")
    pid = runner_state(stack.store, "sd-idle").pid
    assert pid is not None
    started = time.monotonic()
    response = stack.api.post("/v1/runners/tiny@sd-idle/shutdown", json={"mode": "warm"})
    assert response.status_code == 202
    state = wait_runner(stack.store, "sd-idle", "Shutdown", 2)
    wait_until(
        lambda: not psutil.pid_exists(pid),
        2 - (time.monotonic() - started),
        "the runner process to exit",
    )
    assert state.error is None
    history = [c["status"] for c in stack.api.get("/v1/runners/tiny@sd-idle").json()["history"]]
    assert history[-2:] == ["ShuttingDown", "Shutdown"]
    again = stack.api.post("/v1/runners/tiny@sd-idle/shutdown", json={"mode": "warm"})
    assert again.status_code == 409

    assert (
        stack.api.post("/v1/runners", json={"model": "tiny", "host": "sd-idle"}).status_code == 202
    )
    restarted = wait_runner(stack.store, "sd-idle", "Ready", 30)
    assert restarted.pid != pid
    job = stack.api.wait_job(stack.api.submit(prompt="back", max_tokens=4, host="sd-idle"))
    assert job["status"] == "succeeded" and job["runner_id"] == "tiny@sd-idle"


def test_warm_shutdown_finishes_short_jobs_and_cuts_long_ones_at_the_timeout(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-warm")
    long_id = stack.api.submit(**LONG, host="sd-warm")
    wait_tokens(stack, long_id)
    short_id = stack.api.submit(prompt="short", max_tokens=20, host="sd-warm")
    started = time.monotonic()
    stack.api.post("/v1/runners/tiny@sd-warm/shutdown", json={"mode": "warm", "timeout_s": 1.5})
    short = stack.api.wait_job(short_id, timeout_s=5)
    long = stack.api.wait_job(long_id, timeout_s=5)
    assert short["status"] == "succeeded"
    assert long["status"] == "failed" and long["output"]["finish_reason"] == "shutdown"
    assert 0 < len(long["output"]["text"]) < 4000
    assert 1.4 < time.monotonic() - started < 3.5
    assert wait_runner(stack.store, "sd-warm", "Shutdown", 3).error is None


def test_hard_shutdown_ends_in_flight_jobs_at_once(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-hard")
    job_id = stack.api.submit(**LONG, host="sd-hard")
    wait_tokens(stack, job_id)
    started = time.monotonic()
    stack.api.post("/v1/runners/tiny@sd-hard/shutdown", json={"mode": "hard"})
    job = stack.api.wait_job(job_id, timeout_s=2)
    assert time.monotonic() - started < 1.5
    assert job["status"] == "failed" and job["output"]["finish_reason"] == "shutdown"
    assert job["output"]["text"] and "shut down" in job["error"]
    wait_runner(stack.store, "sd-hard", "Shutdown", 2)


def test_escalation_sigkills_a_runner_that_does_not_stop(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = new_worker(stack, processes, tiny_model, tmp_path, "sd-stuck")
    pid = runner_state(stack.store, "sd-stuck").pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # deaf to the request and to SIGTERM; only SIGKILL works
    started = time.monotonic()
    stack.api.post("/v1/runners/tiny@sd-stuck/shutdown", json={"mode": "warm", "timeout_s": 0.5})
    state = wait_runner(stack.store, "sd-stuck", "Shutdown", 12)
    elapsed = time.monotonic() - started
    assert state.error == "Terminated (signal 9 SIGKILL)"
    assert 1.5 + 5 <= elapsed < 10  # grace (0.5 s + 1 s), SIGTERM, 5 s, SIGKILL
    # The supervisor logs "runner stopped" just after it writes the state waited for above.
    log = wait_until(lambda: "runner stopped" in (text := worker.log_text()) and text, 2, "log")
    for step in ("stopping runner", "sending SIGTERM", "sending SIGKILL"):
        assert step in log
    assert not psutil.pid_exists(pid)
    time.sleep(1)
    # Stopped on purpose, however it ended: shut down, no restart.
    assert runner_state(stack.store, "sd-stuck").status == "Shutdown"


def test_a_killed_runner_fails_its_jobs_at_once_and_restarts(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-kill")
    ids = [stack.api.submit(**LONG, host="sd-kill") for _ in range(3)]
    for job_id in ids:
        wait_tokens(stack, job_id)
    stream_events: list[str] = []

    def follow_stream() -> None:
        response = stack.api.get(f"/v1/jobs/{ids[0]}/stream", stream=True)
        stream_events.extend(
            line for line in response.iter_lines(decode_unicode=True) if line.startswith("event: ")
        )

    reader = threading.Thread(target=follow_stream, daemon=True)
    reader.start()
    pid = runner_state(stack.store, "sd-kill").pid
    assert pid is not None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    state = wait_runner(stack.store, "sd-kill", "Failed", 1)
    assert state.error == "Terminated (signal 9 SIGKILL)"
    for job_id in ids:
        job = stack.api.wait_job(job_id, timeout_s=2 - (time.monotonic() - killed))
        assert job["status"] == "failed"
        assert "tiny@sd-kill" in job["error"] and "SIGKILL" in job["error"]
    reader.join(timeout=2 - (time.monotonic() - killed))
    assert stream_events[-1] == "event: error"
    restarted = wait_runner(stack.store, "sd-kill", "Ready", 30)
    assert restarted.pid != pid and restarted.restarts == 1
    job = stack.api.wait_job(stack.api.submit(prompt="again", max_tokens=4, host="sd-kill"))
    assert job["status"] == "succeeded"


def test_a_runner_that_keeps_dying_is_left_failed(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-flaky", runner_max_restarts=1)
    first = runner_state(stack.store, "sd-flaky").pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_runner(stack.store, "sd-flaky", "Failed", 1)
    second = wait_runner(stack.store, "sd-flaky", "Ready", 30).pid
    assert second is not None and second != first
    os.kill(second, signal.SIGKILL)
    state = wait_runner(stack.store, "sd-flaky", "Failed", 2)
    assert state.error is not None and "gave up after 2 failures in a row" in state.error
    assert state.next_restart_at is None
    time.sleep(2)
    assert runner_state(stack.store, "sd-flaky").status == "Failed"
    # No runner left to take it: refused up front rather than queued to fail.
    refused = stack.api.post("/v1/jobs", json={"prompt": "x", "host": "sd-flaky"})
    assert refused.status_code == 503
    assert "tiny@sd-flaky: Failed" in refused.json()["error"]["message"]


def test_a_hung_runner_fails_its_jobs_within_the_stall_limit_and_is_stopped_hard(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-hung")  # the default limits
    job_id = stack.api.submit(**LONG, host="sd-hung")
    wait_tokens(stack, job_id)
    pid = runner_state(stack.store, "sd-hung").pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    hung = time.monotonic()
    limit_s = Settings(_env_file=None).decode_timeout_s
    job = stack.api.wait_job(job_id, timeout_s=limit_s + 3)
    assert time.monotonic() - hung < limit_s + 2
    assert job["status"] == "failed" and "stalled in decode" in job["error"]
    # No warm grace for a runner that can finish nothing: SIGTERM at once, SIGKILL 5 s later.
    state = wait_runner(stack.store, "sd-hung", "Failed", 8)
    assert state.error is not None and state.error.startswith("stalled in decode")
    assert "Terminated (signal 9 SIGKILL)" in state.error
    assert time.monotonic() - hung < limit_s + 8
    assert wait_runner(stack.store, "sd-hung", "Ready", 30).pid != pid


def test_soft_time_limit_keeps_partial_text_and_the_warm_model(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    new_worker(stack, processes, tiny_model, tmp_path, "sd-soft")
    before = runner_state(stack.store, "sd-soft")
    started = time.monotonic()
    job = stack.api.wait_job(stack.api.submit(**LONG, host="sd-soft", timeout_s=1))
    assert 1 <= time.monotonic() - started < 2.5
    assert job["status"] == "timed_out" and job["output"]["finish_reason"] == "time_limit"
    assert 0 < job["usage"]["completion_tokens"] < 4000 and job["output"]["text"]
    after = wait_runner(stack.store, "sd-soft", "Ready", 2)
    assert after.pid == before.pid and after.model_loads == 1


@pytest.mark.parametrize("timeout_s", [1e-9, 1e-3, 2e-3, 4e-3])
def test_a_soft_limit_before_the_hand_over_ends_the_job_timed_out(
    stack: Stack, timeout_s: float
) -> None:
    # The limit can fire before the task's body runs, while it reads the job (between a Redis
    # command and its reply), or just after the hand-over: every way the job must end, not
    # stay queued with its message gone, or running.
    host = stack.worker.host  # the session's worker: not one a previous test is stopping
    jobs = [stack.api.submit(**LONG, host=host, timeout_s=timeout_s) for _ in range(8)]
    for job_id in jobs:
        job = stack.api.wait_job(job_id, timeout_s=10)
        assert job["status"] == "timed_out" and job["output"]["finish_reason"] == "time_limit"


def test_the_runner_keeps_the_soft_limit_when_no_signal_brings_it(stack: Stack) -> None:
    # A job handed to the runner with no task behind it, as when the soft limit's signal to the
    # pool child is lost: only the runner's own clock can end it.
    runner_id = runner_id_for("tiny", stack.worker.host)
    before = stack.store.runners.get(runner_id)
    job = JobRecord(id=uuid.uuid4().hex, model="tiny", request=JobRequest.model_validate(LONG))
    stack.store.jobs.create(job, "exo.test-no-task", max_queued=1)
    started = job.model_copy(
        update={"status": JobStatus.RUNNING, "started_at": utcnow(), "runner_id": runner_id}
    )
    handed_over = time.monotonic()
    command = SubmitJob(job=started, soft_deadline=time.time() + 1, deadline=time.time() + 60)
    assert stack.store.runners.hand_over(runner_id, command)

    ended = stack.api.wait_job(job.id, timeout_s=5)
    assert 1 <= time.monotonic() - handed_over < 2.5
    assert ended["status"] == "timed_out" and ended["output"]["finish_reason"] == "time_limit"
    assert 0 < ended["usage"]["completion_tokens"] < 4000 and ended["output"]["text"]
    after = stack.store.runners.get(runner_id)
    assert before is not None and after is not None
    assert after.pid == before.pid and after.status.accepts_jobs


def test_hard_time_limit_replaces_the_pool_child_and_fails_the_job(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = new_worker(stack, processes, tiny_model, tmp_path, "sd-hardlimit")
    # The hard limit is the soft one + 1 s. The soft limit leaves 3 s to stop the runner
    # before it: under load, a second from the first token to the SIGSTOP has been seen.
    with serving(api_settings(stack.redis.url, [tiny_model], job_hard_grace_s=1)) as api:
        job_id = api.submit(**LONG, host="sd-hardlimit", timeout_s=3)
        wait_tokens(stack, job_id)
        pid = runner_state(stack.store, "sd-hardlimit").pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the soft limit's cancel goes unanswered: the child waits
        try:
            job = api.wait_job(job_id, timeout_s=10)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert job["status"] == "failed"
    assert "hard time limit exceeded (4.0s)" in job["error"]
    assert "Hard time limit (4.0s) exceeded" in worker.log_text()
    state = wait_until(
        lambda: (s := runner_state(stack.store, "sd-hardlimit")).active_jobs == 0 and s,
        5,
        "the runner to drop the job",
    )
    assert state.pid == pid and state.status == "Ready"


def received_at(log_text: str, job_id: str) -> datetime:
    """When the worker took the job's message (Celery's "received" line, in the worker's local
    time). A message taken just before the signal is handed over just after it: its record's
    `started_at` can follow the signal by the pool child's few milliseconds (seen on CI)."""
    receipt = re.escape(f"Task {INFERENCE_TASK}[{job_id}] received")
    found = re.search(rf"ts=(\S+) .*{receipt}", log_text)
    assert found, f"no receipt of job {job_id} in the worker's log"
    return datetime.fromisoformat(found.group(1)).astimezone(UTC)


@pytest.mark.parametrize("how", ["sigterm", "api"])
def test_warm_worker_shutdown_finishes_or_requeues_and_a_restart_completes_every_job(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, how: str
) -> None:
    host = f"sd-worker-{how}"
    worker = new_worker(
        stack, processes, tiny_model, tmp_path, host, worker_concurrency=2, worker_soft_shutdown_s=2
    )
    long_id = stack.api.submit(**IN_FLIGHT, host=host)
    wait_tokens(stack, long_id)
    short_id = stack.api.submit(prompt="short", max_tokens=200, ignore_eos=True, host=host)
    # In flight beside the long one before the stop: on a loaded machine a job submitted just
    # before it may still be in the queue (and rightly stays there).
    wait_tokens(stack, short_id)
    queued = [stack.api.submit(prompt=f"q{i}", max_tokens=8, host=host) for i in range(3)]
    signalled_at = utcnow()
    started = time.monotonic()
    if how == "sigterm":
        worker.process.send_signal(signal.SIGTERM)
    else:
        assert (
            stack.api.post(f"/v1/hosts/{host}/shutdown", json={"mode": "warm"}).status_code == 202
        )
    worker.process.wait(timeout=15)
    assert time.monotonic() - started < 2 + 5  # the window, then the runner's quick stop
    assert stack.api.get(f"/v1/jobs/{short_id}").json()["status"] == "succeeded"
    long = stack.api.get(f"/v1/jobs/{long_id}").json()
    assert long["status"] == "queued" and long["attempts"] == 1  # requeued, not lost
    for job_id in queued:
        job = stack.store.jobs.get(job_id)
        assert job is not None
        if job.started_at is None:  # left in the queue, untouched
            assert (job.status, job.attempts) == (JobStatus.QUEUED, 0)
        else:  # a slot the short job freed took it (before the API's stop reached the worker)
            assert job.status == JobStatus.SUCCEEDED
            if how == "sigterm":  # none is taken once the worker has the signal
                # Handed to the runner as it was submitted (exo_tasks.direct), or by its task.
                direct = job.direct and job.started_at is not None
                taken_at = job.started_at if direct else received_at(worker.log_text(), job_id)
                assert taken_at is not None and taken_at < signalled_at
    report_margin(stack, long_id)

    new_worker(stack, processes, tiny_model, tmp_path, host)
    for job_id in [long_id, short_id, *queued]:
        assert stack.api.wait_job(job_id, timeout_s=60)["status"] == "succeeded"
    events = stack.store.streams.read_events(long_id)
    assert [e.event for _, e in events].count("done") == 1


def test_an_idle_workers_pool_is_gone_at_once_on_a_warm_shutdown(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    """Its runner stopped already: the worker's stop is Celery's and the rest of ours. Each
    pool child used to sleep 1 s before it exited (billiard's wait for the worker's SIGTERM,
    which never comes while the worker stops), and Celery's loop saw the signal up to 1 s
    late: the worker overran the launcher's 3.5 s stage on 2 busy cores."""
    worker = new_worker(stack, processes, tiny_model, tmp_path, "sd-quick")
    assert stack.api.post("/v1/runners/tiny@sd-quick/shutdown", json={}).status_code == 202
    wait_runner(stack.store, "sd-quick", "Shutdown", 10)
    ended = re.compile(r"Task exo\.shutdown_runner\[\S+\] succeeded")
    wait_until(lambda: ended.search(worker.log_text()), 10, "the shutdown task's end")
    celery = stack.api.app.extensions["exo"].celery
    stats = celery.control.inspect(destination=["exo@sd-quick"], timeout=5).stats()
    pool = stats["exo@sd-quick"]["pool"]["processes"]
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    wait_until(lambda: all(has_exited(pid) for pid in pool), 10, "the pool children gone", 0.01)
    pool_gone = time.monotonic() - started
    assert worker.process.wait(timeout=10) == 0
    took = time.monotonic() - started
    print(f"idle worker: pool gone {pool_gone:.2f}s, worker {took:.2f}s after SIGTERM")
    # Under the second each child slept (the defect's least), whatever the machine's load:
    # three test processes on two cores have taken 0.8 s.
    assert pool_gone < 0.95, worker.log_text()[-3000:]


@pytest.mark.parametrize("how", ["api", "second-ctrl-c"])
def test_cold_worker_shutdown_requeues_in_flight_jobs_never_succeeding_them(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, how: str
) -> None:
    host = f"sd-cold-{how}"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    job_id = stack.api.submit(**IN_FLIGHT, host=host)
    wait_tokens(stack, job_id)
    if how == "api":
        started = time.monotonic()
        response = stack.api.post(f"/v1/hosts/{host}/shutdown", json={"mode": "cold"})
        assert response.status_code == 202
    else:
        worker.process.send_signal(signal.SIGINT)  # warm: the job keeps running
        wait_until(lambda: "Warm shutdown" in worker.log_text(), 5, "the warm shutdown")
        assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
        started = time.monotonic()  # the bound is the cold stop's, from the second signal
        worker.process.send_signal(signal.SIGINT)
    worker.process.wait(timeout=15)
    assert time.monotonic() - started < 5
    assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    report_margin(stack, job_id)

    new_worker(stack, processes, tiny_model, tmp_path, host)
    job = stack.api.wait_job(job_id, timeout_s=60)
    assert job["status"] == "succeeded" and job["attempts"] >= 1
    assert job["usage"]["completion_tokens"] == IN_FLIGHT["max_tokens"]
    assert [e.event for _, e in stack.store.streams.read_events(job_id)].count("done") == 1


@contextlib.contextmanager
def pool_children_held(worker: Worker) -> Iterator[None]:
    """The worker's pool children SIGSTOPped for the block: a task it receives meanwhile waits
    in a child's pipe, taken only once they go on, as on a loaded machine."""
    children = pool_children(worker)
    for child in children:
        child.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("how", ["warm", "second-ctrl-c"])
def test_a_stop_stays_bounded_for_a_task_taken_after_it_began(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, how: str
) -> None:
    """A direct job's runner starts it before its task is delivered: its task can reach a pool
    child after the warm stop began, where Celery's cold stop does not cancel it and no one
    reads its result. The cold stop still requeues the job at once and ends within its bound;
    the warm one ends soon after the job does (billiard's child waited 30 s for its result to
    be read)."""
    host = f"sd-late-{how}"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    with pool_children_held(worker):
        job_id = stack.api.submit(**IN_FLIGHT, host=host)
        wait_tokens(stack, job_id)
        wait_until(lambda: job_id in worker.log_text(), 5, "the task's delivery")
        worker.process.send_signal(signal.SIGINT)
        wait_until(lambda: "Warm shutdown" in worker.log_text(), 5, "the warm shutdown")
        if how == "second-ctrl-c":
            started = time.monotonic()  # the cold stop's bound runs from its signal
            worker.process.send_signal(signal.SIGINT)
    if how == "warm":  # the bound runs from the job's end
        assert stack.api.wait_job(job_id, timeout_s=30)["status"] == "succeeded"
        started = time.monotonic()
    worker.process.wait(timeout=15)
    assert time.monotonic() - started < 5, worker.log_text()[-3000:]
    if how == "warm":
        return
    assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    new_worker(stack, processes, tiny_model, tmp_path, host)
    job = stack.api.wait_job(job_id, timeout_s=60)
    assert job["status"] == "succeeded"
    assert job["usage"]["completion_tokens"] == IN_FLIGHT["max_tokens"]
    assert [e.event for _, e in stack.store.streams.read_events(job_id)].count("done") == 1


def test_unknown_host_shutdown_is_404(stack: Stack) -> None:
    response = stack.api.post("/v1/hosts/nowhere/shutdown", json={"mode": "warm"})
    assert response.status_code == 404 and "nowhere" in response.json()["error"]["message"]


def test_runners_exit_when_their_worker_is_killed(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    worker = new_worker(stack, processes, tiny_model, tmp_path, "sd-orphan")
    pid = runner_state(stack.store, "sd-orphan").pid
    assert pid is not None
    children = psutil.Process(worker.pid).children(recursive=True)
    worker.process.send_signal(signal.SIGKILL)
    wait_until(lambda: has_exited(pid), 5, "the orphaned runner to exit")
    wait_until(lambda: all(has_exited(c.pid) for c in children), 5, "the pool children to exit")
