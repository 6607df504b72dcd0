"""Stopping a whole local stack, as users do: Ctrl-C (once, twice), a closed terminal, a killed
launcher, `exo-tasks down`, and a plain `honcho start` on the Procfile. Real processes, real
signals, default settings, fresh data dirs (the worker makes the default model itself).

Every stop must leave no process behind and lose no job: jobs in flight go back to their queue
(record `queued`, `attempts` 1, `event: requeued`, message back in the queue) before Redis stops.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import requests

from config.settings import DEFAULT_PRESET
from exo_tasks import broker
from exo_tasks.fleet_types import RunnerState
from exo_tasks.launcher import PROCFILE, RecordedProcess, StackRecord
from exo_tasks.naming import host_queue
from exo_tasks.redis_server import ORPHANED_WORKER_WAIT_S, WORKER_WAIT_S
from exo_tasks.store import Store
from exo_tasks.store.keys import job_key
from exo_tasks.types import model_queue, runner_id_for
from tests.support.launcher import HOST, JOBS, LONG_JOB, LocalStack
from tests.support.processes import (
    EXO_TASKS,
    Processes,
    RedisServer,
    start_redis,
    wait_until,
)
from tests.support.workers import start_worker


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def stop_and_time(
    stack: LocalStack,
    signals: list[signal.Signals],
    bound_s: float,
    gap_s: float = 0.3,
    before: Callable[[], None] = lambda: None,
) -> float:
    """Call `before`, send `signals` to the launcher (`gap_s` apart); every process of the stack
    must be gone within `bound_s`. Returns how long that took."""
    tree = stack.tree()
    assert stack.process is not None
    started = time.monotonic()
    before()
    for i, signum in enumerate(signals):
        if i:
            time.sleep(gap_s)
        stack.process.send_signal(signum)
    deadline = started + bound_s
    while (alive := _running(tree)) and time.monotonic() < deadline:
        stack.process.poll()  # reap the launcher
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    assert not alive, (
        f"still running after {bound_s}s:\n"
        + "".join(f"  {_described(p)}\n" for p in alive)
        + stack.log_text()[-3000:]
    )
    return elapsed


def _described(proc: psutil.Process) -> str:
    """Enough to tell which process of the stack it is and what it does: the pool's children
    share the worker's command line, its parent tells them apart."""
    try:
        with proc.oneshot():
            return (
                f"pid {proc.pid} ppid {proc.ppid()} {proc.status()} "
                f"threads {proc.num_threads()} {proc.name()!r}: {shlex.join(proc.cmdline())}"
            )
    except psutil.Error as exc:
        return f"pid {proc.pid}: {exc!r}"


@contextlib.contextmanager
def stopped_store(stack: LocalStack) -> Iterator[Store]:
    """The stopped stack's Redis data (its AOF), read with a redis-server of our own."""
    redis = start_redis(stack.processes, stack.data_dir / "redis", port=stack.redis_port)
    try:
        yield Store.from_url(redis.url)
    finally:
        redis.process.terminate()
        redis.process.wait(timeout=10)


def assert_requeued(stack: LocalStack, ids: list[str]) -> None:
    """Every job is queued again, once, with its message back in the queue it was sent to:
    the model's, or for a job handed to its runner as it was submitted (exo_tasks.direct), its
    host's own, which the host's next worker consumes first. A job its task sent to its model's
    queue as the worker stopped may have its first message back in its host's queue as well:
    the task's acknowledgement of it and kombu's restore of unacknowledged messages at the
    connection's close race in Celery's stop. Whichever copy comes second finds the job taken
    (the restart below runs each job once)."""
    with stopped_store(stack) as store:
        for job_id in ids:
            job = store.jobs.get(job_id)
            assert job is not None and job.status == "queued" and job.attempts == 1, job
            events = [event.event for _, event in store.streams.read_events(job_id)]
            assert events.count("requeued") == 1, events
        queues = {
            model_queue(DEFAULT_PRESET),
            *(store.redis.hget(job_key(j), "queue") for j in ids),
        }
        assert queues <= {model_queue(DEFAULT_PRESET), host_queue(HOST)}, queues
        assert len(ids) <= sum(store.jobs.queue_depth(queue) for queue in queues) <= 2 * len(ids)
        assert store.redis.hlen("unacked") == 0


def test_ctrl_c_requeues_jobs_in_flight_a_restart_runs_them_and_down_stops_it(
    local_stack: LocalStack,
) -> None:
    local_stack.up()
    assert (local_stack.data_dir / "models" / DEFAULT_PRESET / "config.json").is_file()
    ids = local_stack.submit_long_jobs()
    elapsed = stop_and_time(local_stack, [signal.SIGINT], bound_s=6)
    print(f"Ctrl-C with {JOBS} jobs in flight: every process gone in {elapsed:.2f}s")
    assert local_stack.process is not None and local_stack.process.wait(timeout=1) == 0
    assert "SIGKILL" not in local_stack.log_text()
    assert not (local_stack.data_dir / "run" / "stack.json").exists()
    assert_requeued(local_stack, ids)

    local_stack.up()
    wait_until(lambda: local_stack.all_succeeded(ids), 60, "every job")
    for job_id in ids:
        assert local_stack.job(job_id)["usage"]["completion_tokens"] == LONG_JOB["max_tokens"]
        events = [event.event for _, event in local_stack.store().streams.read_events(job_id)]
        assert events.count("done") == 1, events

    tree = local_stack.tree()
    down = subprocess.run(
        [EXO_TASKS, "down"], env=local_stack.env, capture_output=True, text=True, timeout=30
    )
    assert down.returncode == 0, down.stderr
    assert f"launcher pid {tree[0].pid}" in down.stdout and "stopped" in down.stdout
    local_stack.process.wait(timeout=5)
    assert not _running(tree)
    again = subprocess.run(
        [EXO_TASKS, "down"], env=local_stack.env, capture_output=True, text=True, timeout=30
    )
    assert again.returncode == 1 and "nothing to stop" in again.stdout


def test_a_second_ctrl_c_stops_at_once_still_requeuing(local_stack: LocalStack) -> None:
    local_stack.up()
    ids = local_stack.submit_long_jobs()
    elapsed = stop_and_time(local_stack, [signal.SIGINT, signal.SIGINT], bound_s=5)
    print(f"two Ctrl-C: every process gone in {elapsed:.2f}s")
    assert "second signal" in local_stack.log_text()
    assert_requeued(local_stack, ids)


@pytest.mark.parametrize("how", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_a_hangup_or_a_killed_launcher_stops_everything(
    local_stack: LocalStack, how: signal.Signals
) -> None:
    local_stack.up()
    ids = local_stack.submit_long_jobs()
    elapsed = stop_and_time(local_stack, [how], bound_s=10)
    print(f"{how.name} to the launcher: every process gone in {elapsed:.2f}s")
    assert_requeued(local_stack, ids)


def test_a_killed_launcher_whose_worker_does_not_stop_still_stops_everything(
    local_stack: LocalStack,
) -> None:
    """A loaded machine (CI) slowed the worker's stop past the 4 s that Redis waits for it under
    honcho; with the launcher dead, Redis stopped under the worker, whose tasks then waited for
    Redis to come back: nothing stopped. Here the worker is frozen for good at the launcher's
    death: Redis must outwait the 4 s, then SIGKILL the worker (no launcher is left to) and
    stop; the worker's jobs stay running, for the recovery loop of its next start. Its runner
    is not frozen and decodes until Redis stops, 7.5 s on: 1,500-token jobs were done by then on
    a quiet machine (succeeded, rightly)."""
    local_stack.up()
    ids = local_stack.submit_long_jobs()
    tree = local_stack.tree()
    worker = next(p for p in tree[0].children() if "worker" in p.cmdline())
    redis_server = next(p for p in tree if p.name() == "redis-server")
    redis_up_later: list[bool] = []
    look = threading.Timer(
        WORKER_WAIT_S + 1.5, lambda: redis_up_later.append(redis_server.is_running())
    )

    def freeze() -> None:
        worker.suspend()
        look.start()

    try:
        elapsed = stop_and_time(local_stack, [signal.SIGKILL], bound_s=10, before=freeze)
    finally:
        look.cancel()
    print(f"launcher SIGKILLed, worker frozen: every process gone in {elapsed:.2f}s")
    assert redis_up_later == [True], "Redis stopped before the worker, 4 s after the launcher died"
    assert elapsed > ORPHANED_WORKER_WAIT_S
    with stopped_store(local_stack) as store:
        for job_id in ids:
            job = store.jobs.get(job_id)
            assert job is not None and (job.status, job.attempts) == ("running", 0), job
            print(f"job {job_id}: {store.streams.streamed_text(job_id)[1]} tokens streamed")
        # Each job's message is still with the broker, for the next start: unacknowledged (kombu
        # gives it back), or not yet fetched. The latter when the worker froze before its pool
        # grew to take it: each job streams from its hand-over to the runner, not its task.
        messages = broker.read_messages(
            store.redis, [model_queue(DEFAULT_PRESET), host_queue(HOST)]
        )
        held = [*messages.queued_task_ids, *(str(u.task_id) for u in messages.unacked)]
        print(f"{len(messages.queued_task_ids)} queued, {len(messages.unacked)} unacknowledged")
        assert sorted(held) == sorted(ids), held


def test_closing_the_terminal_stops_everything(local_stack: LocalStack) -> None:
    terminal = local_stack.up_in_terminal()
    ids = local_stack.submit_long_jobs()
    elapsed = stop_and_time(local_stack, [], bound_s=10, before=terminal.close)
    print(f"the terminal closed: every process gone in {elapsed:.2f}s")
    assert local_stack.process is not None and local_stack.process.wait(timeout=1) == 0
    assert_requeued(local_stack, ids)


def test_honcho_start_on_the_procfile_works_and_ctrl_c_requeues(
    local_stack: LocalStack,
) -> None:
    # As the README runs it: `.venv/bin/honcho start` from the project's root, the venv not
    # activated (its bin not on PATH).
    venv_bin = Path(sys.executable).parent
    path = local_stack.env["PATH"].split(os.pathsep)
    local_stack.env["PATH"] = os.pathsep.join(p for p in path if Path(p) != venv_bin)
    honcho = [str(venv_bin / "honcho"), "start"]
    # /readyz: the runner is Ready on a fresh data dir.
    local_stack.start(honcho, cwd=PROCFILE.parent)
    ids = local_stack.submit_long_jobs()
    # honcho itself SIGKILLs what is left 5 s after Ctrl-C: nothing may need that.
    elapsed = stop_and_time(local_stack, [signal.SIGINT], bound_s=6)
    print(f"honcho, Ctrl-C with {JOBS} jobs in flight: every process gone in {elapsed:.2f}s")
    assert "stopping Redis before the worker" not in local_stack.log_text()
    assert_requeued(local_stack, ids)


def test_up_refuses_a_taken_port_naming_its_holder(local_stack: LocalStack) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(local_stack.env["EXO_API_PORT"])))
        holder.listen()
        result = subprocess.run(
            [EXO_TASKS, "up"], env=local_stack.env, capture_output=True, text=True, timeout=30
        )
    assert result.returncode == 2
    port = local_stack.env["EXO_API_PORT"]
    # The holder named by its pid and its command line: this test's process, pytest's or a
    # pytest-xdist worker's.
    named = f"pid {psutil.Process().pid}: {shlex.join(psutil.Process().cmdline())}"
    assert f"port {port} (EXO_API_PORT) is taken by {named}" in result.stderr
    assert "exo-tasks down" in result.stderr


def test_a_host_shutdown_stops_only_the_worker(local_stack: LocalStack) -> None:
    local_stack.up()
    launcher = local_stack.tree()[0]
    worker = next(p for p in launcher.children() if "worker" in p.cmdline())
    response = requests.post(
        f"{local_stack.api}/v1/hosts/{HOST}/shutdown", json={"mode": "warm"}, timeout=10
    )
    assert response.status_code == 202
    worker.wait(timeout=15)
    assert local_stack.process is not None and local_stack.process.poll() is None
    assert requests.get(f"{local_stack.api}/healthz", timeout=5).status_code == 200
    refused = requests.post(f"{local_stack.api}/v1/jobs", json={"prompt": "x"}, timeout=5)
    assert refused.status_code == 404
    assert "not served by any live host" in refused.json()["error"]["message"]
    assert "child=worker exitcode=0" in local_stack.log_text()
    stop_and_time(local_stack, [signal.SIGINT], bound_s=6)


def test_a_missing_model_path_fails_the_runner_for_good(
    redis_server: RedisServer, store: Store, processes: Processes, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    worker = start_worker(processes, redis_server.url, "stack-missing", [missing], tmp_path)
    runner_id = runner_id_for("no-such-model", "stack-missing")

    def failed() -> RunnerState | None:
        state = store.runners.get(runner_id)
        # The runner says Failed as it exits; the supervisor then adds how it ended.
        return state if state is not None and "not restarted" in (state.error or "") else None

    state: RunnerState = wait_until(failed, 60, f"runner {runner_id} Failed")
    assert state.error is not None
    assert f"model path '{missing}' does not exist (exitcode=78)" in state.error
    time.sleep(2)  # the first restart would have come after 0.5 s
    again = store.runners.get(runner_id)
    assert again is not None and again.status == "Failed" and again.restarts == 0
    assert worker.process.poll() is None


def test_down_stops_the_processes_of_a_launcher_that_is_gone_in_order(
    local_stack: LocalStack, processes: Processes, tmp_path: Path
) -> None:
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf')"
    commands = {  # the api ignores SIGTERM: it gets SIGKILL past its bound
        "redis": ["sleep", "60"],
        "api": [sys.executable, "-u", "-c", deaf + "; time.sleep(60)"],
        "worker": ["sleep", "60"],
        "flower": ["sleep", "60"],
    }
    members = {
        name: processes.start(argv, local_stack.env, tmp_path / f"{name}.log")
        for name, argv in commands.items()
    }
    wait_until(lambda: "deaf" in (tmp_path / "api.log").read_text(), 10, "the api to ignore TERM")
    record = StackRecord(
        # A pid above the kernel's limit: a launcher that is surely gone.
        launcher=RecordedProcess(name="launcher", pid=2**22 + 1, create_time=0.0),
        processes=[RecordedProcess.of(n, psutil.Process(p.pid)) for n, p in members.items()],
    )
    path = local_stack.data_dir / "run" / "stack.json"
    path.parent.mkdir(parents=True)
    path.write_text(record.model_dump_json())
    down = subprocess.run(
        [EXO_TASKS, "down"], env=local_stack.env, capture_output=True, text=True, timeout=30
    )
    assert down.returncode == 0, down.stderr
    assert "is gone; stopping what is left of its stack" in down.stdout
    assert f"worker (pid {members['worker'].pid})" in down.stdout
    order = [
        line.split("child=")[1].split()[0]
        for line in down.stderr.splitlines()
        if "msg=stopping " in line
    ]
    assert order == ["worker", "api", "flower", "redis"], down.stderr
    assert "did not stop in time; sending SIGKILL" in down.stderr and "child=api" in down.stderr
    for name, process in members.items():
        expected = -signal.SIGKILL if name == "api" else -signal.SIGTERM
        assert process.wait(timeout=2) == expected, name
    assert not path.exists()
