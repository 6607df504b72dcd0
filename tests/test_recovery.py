"""Recovery when the stopper itself dies: a worker SIGKILLed, a message lost in kombu's fetch
window, a cancel for a job whose worker is gone. Default settings (visibility timeout 3600 s):
every bound below comes from heartbeats and the recovery loop, never from redelivery.

The session's own worker (host-a) stays alive throughout and holds the recovery loop's lease,
as a second host of a fleet would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import requests

from exo_tasks import broker, fairness, jobs
from exo_tasks.broker import Broker
from exo_tasks.fleet_types import HostState
from exo_tasks.naming import host_queue
from exo_tasks.recovery import HEARTBEAT_TTL_S, Recovery
from exo_tasks.types import JobRecord, JobRequest, utcnow
from tests.support.processes import Processes, wait_until
from tests.support.stack import Stack, new_worker, wait_tokens
from tests.support.workers import Worker, runner_state

# A job long enough to be in flight when the worker dies, short enough to finish quickly after.
# Long enough to be in flight when the test kills their worker, however loaded the machine.
MEDIUM = {"prompt": "medium", "max_tokens": 2000, "ignore_eos": True}
# Within this long of a dead worker's heartbeat going stale, its jobs are queued again.
REQUEUE_BOUND_S = 15.0
# From a lapsed heartbeat's return to its host's runner Ready again: the next beat (at once),
# the runner's command, its publish.
RESTATED_S = 5.0


def follow(stack: Stack, job_id: str, events: list[str]) -> threading.Thread:
    """Collect the event names of a job's SSE stream in the background."""

    def read() -> None:
        with requests.get(f"{stack.api.url}/v1/jobs/{job_id}/stream", stream=True, timeout=90) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def jobs_in_flight(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path, host: str, count: int
) -> tuple[Worker, list[str]]:
    """A worker of its own on `host`, streaming `count` jobs pinned to it."""
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    ids = [stack.api.submit(**MEDIUM, host=host) for _ in range(count)]
    for job_id in ids:
        wait_tokens(stack, job_id)
    return worker, ids


def in_a_queue(stack: Stack, job_id: str, queue: str) -> bool:
    """The job's message waits in `queue` (not in kombu's unacked hash)."""
    return job_id in broker.read_messages(stack.store.redis, [queue]).queued_task_ids


def test_a_sigkilled_workers_jobs_are_requeued_from_its_heartbeat_not_the_broker(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host = "rc-kill"
    worker, ids = jobs_in_flight(stack, processes, tiny_model, tmp_path, host, 3)
    events: list[str] = []
    reader = follow(stack, ids[0], events)
    killed = time.monotonic()
    worker.process.send_signal(signal.SIGKILL)

    def all_requeued() -> bool:
        jobs = [stack.store.jobs.get(j) for j in ids]
        return all(
            j is not None
            and j.status == "queued"
            and j.attempts == 1
            and in_a_queue(stack, j.id, host_queue(host))
            for j in jobs
        )

    wait_until(all_requeued, HEARTBEAT_TTL_S + REQUEUE_BOUND_S, "the jobs requeued", interval_s=0.2)
    requeued_s = time.monotonic() - killed
    assert requeued_s > HEARTBEAT_TTL_S - 3  # decided by the heartbeat, not by anything faster
    state = wait_until(
        lambda: (s := runner_state(stack.store, host)).status == "Failed" and s, 5, "runner Failed"
    )
    assert state.error == f"host exo@{host} gone (no heartbeat)"
    ready = stack.api.get("/readyz").json()["ready_runners"]
    assert f"tiny@{host}" not in ready and "tiny@host-a" in ready
    wait_until(lambda: "requeued" in events, 2, "event: requeued on the stream")

    new_worker(stack, processes, tiny_model, tmp_path, host)
    for job_id in ids:
        job = stack.api.wait_job(job_id, timeout_s=60)
        assert job["status"] == "succeeded" and job["attempts"] == 1
        assert job["usage"]["completion_tokens"] == MEDIUM["max_tokens"]
        assert [e.event for _, e in stack.store.streams.read_events(job_id)].count("done") == 1
    reader.join(timeout=5)
    assert events[-1] == "done" and events.count("requeued") == 1


def test_a_runner_written_failed_while_its_hosts_heartbeat_lapsed_is_ready_when_it_beats_again(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    # A worker whose heartbeat stops beyond its TTL (here its main process stopped; a stall or a
    # busy machine alike) is taken for gone and its runner written Failed, while the runner runs
    # on. Once the heartbeat is back, so is the runner: before, it stayed Failed until a job
    # came, and none came (the API refuses a Failed runner's model: 18 failures in one run).
    host = "rc-lapse"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    worker.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(
            lambda: runner_state(stack.store, host).status == "Failed",
            HEARTBEAT_TTL_S + REQUEUE_BOUND_S,
            "runner Failed",
        )
    finally:
        worker.process.send_signal(signal.SIGCONT)
    wait_until(
        lambda: runner_state(stack.store, host).status == "Ready", RESTATED_S, "runner Ready"
    )
    assert f"tiny@{host}" in stack.api.get("/readyz").json()["ready_runners"]
    job = stack.api.wait_job(stack.api.submit(prompt="back", max_tokens=8, host=host))
    assert job["status"] == "succeeded"


def test_a_worker_restarted_at_once_requeues_its_previous_incarnations_jobs_at_once(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host = "rc-restart"
    worker, submitted = jobs_in_flight(stack, processes, tiny_model, tmp_path, host, 2)
    # The jobs running at the kill: under load a second job has started 3.5 s after the first,
    # which had ended by then.
    ids = [j for j in submitted if (now := stack.store.jobs.get(j)) and now.status == "running"]
    assert ids, "no job in flight at the kill"
    killed = time.time()
    worker.process.send_signal(signal.SIGKILL)
    worker.process.wait(timeout=5)
    new_worker(stack, processes, tiny_model, tmp_path, host)  # heartbeat not expired
    for job_id in ids:
        job = stack.api.wait_job(job_id, timeout_s=60)
        assert job["status"] == "succeeded" and job["attempts"] == 1
        # The requeue itself (its event's stream id is Redis's clock, in ms), not the model's
        # load or the jobs after it: before the old heartbeat could expire. Three paths may
        # take a job there first, each logged where it runs: the new worker's start, the
        # recovery loop (another worker's: the host's heartbeat names the new incarnation), or
        # the delivery of its message, which the start gave back.
        [requeued_ms] = [
            int(entry.split("-")[0])
            for entry, event in stack.store.streams.read_events(job_id)
            if event.event == "requeued"
        ]
        assert requeued_ms / 1000 - killed < HEARTBEAT_TTL_S


def test_a_queued_job_whose_message_was_lost_is_sent_again_exactly_once(stack: Stack) -> None:
    # As when a worker is SIGKILLed between kombu's BRPOP and its record of the message as
    # unacknowledged: the job is queued, and its message is nowhere.
    job = JobRecord(
        id=uuid.uuid4().hex,
        model="tiny",
        request=JobRequest.model_validate({"prompt": "lost", "max_tokens": 8}),
    )
    assert stack.store.jobs.create(job, "exo.model.tiny", max_queued=1_000).depth == 0
    started = time.monotonic()
    ended = stack.api.wait_job(job.id, timeout_s=30)
    assert ended["status"] == "succeeded" and ended["attempts"] == 0
    assert time.monotonic() - started < 30
    time.sleep(3)  # a second message would have run by now
    assert [e.event for _, e in stack.store.streams.read_events(job.id)].count("done") == 1


def test_a_cancel_for_a_job_whose_worker_died_is_final(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host = "rc-cancel"
    worker, (early, late) = jobs_in_flight(stack, processes, tiny_model, tmp_path, host, 2)
    worker.process.send_signal(signal.SIGKILL)
    worker.process.wait(timeout=5)

    # Before the heartbeat expires the worker still counts as alive: the cancel is remembered.
    response = stack.api.post(f"/v1/jobs/{early}/cancel")
    assert response.status_code == 202
    # Once it has expired, the cancel ends the job itself.
    wait_until(
        lambda: stack.store.hosts.get(host) is None, HEARTBEAT_TTL_S + 2, "the heartbeat to expire"
    )
    response = stack.api.post(f"/v1/jobs/{late}/cancel")
    assert response.status_code == 202 and response.json()["status"] in ("cancelled", "queued")

    for job_id in (early, late):
        job = stack.api.wait_job(job_id, timeout_s=REQUEUE_BOUND_S)
        assert job["status"] == "cancelled" and job["output"]["finish_reason"] == "cancelled"
    new_worker(stack, processes, tiny_model, tmp_path, host)
    time.sleep(3)  # a redelivered message would have started by now
    for job_id in (early, late):
        assert stack.api.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
        assert [e.event for _, e in stack.store.streams.read_events(job_id)].count("done") == 1


def test_a_job_pinned_to_a_runner_stopped_on_purpose_waits_queued_for_its_load(
    stack: Stack, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host = "rc-pinned"
    new_worker(stack, processes, tiny_model, tmp_path, host)
    pid = runner_state(stack.store, host).pid
    assert pid is not None
    # Deaf to the stop and to SIGTERM, as a runner slow to exit under load: the hard stop needs
    # the escalation, and is still a stop on purpose.
    os.kill(pid, signal.SIGSTOP)
    try:
        stop = stack.api.post(f"/v1/runners/tiny@{host}/shutdown", json={"mode": "hard"})
        assert stop.status_code == 202
        wait_until(lambda: runner_state(stack.store, host).status.is_final, 12, "its stop")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    stopped = runner_state(stack.store, host)
    assert (stopped.status, stopped.error) == ("Shutdown", "Terminated (signal 9 SIGKILL)")
    # Queued before the API could see the stop (as a job already waiting in the queue would be).
    job = JobRecord(
        id=uuid.uuid4().hex,
        model="tiny",
        request=JobRequest.model_validate({"prompt": "wait", "max_tokens": 4, "host": host}),
    )
    stack.store.jobs.create(job, host_queue(host), max_queued=1_000)
    context = stack.api.app.extensions["exo"]
    jobs.send(context.celery, context.settings, job, host_queue(host))
    time.sleep(4)
    assert stack.api.get(f"/v1/jobs/{job.id}").json()["status"] == "queued"  # not failed
    assert stack.api.post("/v1/runners", json={"model": "tiny", "host": host}).status_code == 202
    assert stack.api.wait_job(job.id, timeout_s=60)["status"] == "succeeded"


def test_a_job_sent_again_waits_at_the_step_its_client_gave_it(stack: Stack) -> None:
    # The recovery loop's resend: a job that waited at a later step of its class, behind other
    # clients' first jobs, goes back there, not ahead of them.
    host = f"nobody-{uuid.uuid4().hex[:6]}"  # no worker consumes its queue
    client = fairness.client_of(host, None, None).key
    request = JobRequest.model_validate({"prompt": "x", "max_tokens": 1, "host": host})
    queued = [JobRecord(id=uuid.uuid4().hex, model="tiny", request=request) for _ in range(3)]
    steps = [stack.store.jobs.create(j, host_queue(host), 1_000, client, 10).step for j in queued]
    assert steps == [3, 4, 5]
    context = stack.api.app.extensions["exo"]
    try:
        jobs.resend(stack.store, context.celery, context.settings, queued[2])
        waiting = stack.store.redis.lrange(broker.queue_lists(host_queue(host))[5], 0, -1)
        assert [json.loads(raw)["headers"]["id"] for raw in waiting] == [queued[2].id]
    finally:
        for job in queued:
            jobs.cancel(stack.store, job.id, jobs.CancelledBy.API, celery=None)
        stack.store.redis.delete(*broker.queue_lists(host_queue(host)))


def test_a_message_started_but_stuck_in_a_live_workers_pool_goes_back_to_its_queue(
    stack: Stack,
) -> None:
    # Seen under heavy load: a pool child accepted a task and never went further, its job
    # queued for good behind a live worker that lists the message as held.
    queue, tag = f"exo.model.stuck-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    job = JobRecord(
        id=uuid.uuid4().hex,
        model="stuck",
        request=JobRequest.model_validate({"prompt": "x", "max_tokens": 1}),
    )
    stack.store.jobs.create(job, queue, max_queued=10)
    message = {
        "body": "",
        "headers": {"id": job.id},
        "properties": {"delivery_tag": tag, "priority": 5, "delivery_info": {}},
    }
    started = time.time() - 2
    stack.store.redis.hset(broker.UNACKED, tag, json.dumps([message, "", queue]))
    stack.store.redis.zadd(broker.UNACKED_INDEX, {tag: started})
    holder = HostState(
        name="stuck-host",
        pid=1,
        incarnation="stuck-host:1:1",
        models=[],
        held=[tag],
        started_at=utcnow(),
    )
    stack.store.hosts.publish(holder, HEARTBEAT_TTL_S)
    context = stack.api.app.extensions["exo"]
    loop = Recovery(
        stack.store,
        Broker(stack.store.redis, context.celery.connection_for_write),
        lambda job: None,
        lambda job_id: False,
        host="stuck-host",
        incarnation="stuck-host:1:1",
        stuck_after_s=60,
    )
    loop.sweep()  # held, and started only 2 s ago: left alone
    assert not in_a_queue(stack, job.id, queue)
    loop.stuck_after_s = 1
    loop.sweep()
    assert in_a_queue(stack, job.id, queue)
    assert stack.store.redis.hget(broker.UNACKED, tag) is None
