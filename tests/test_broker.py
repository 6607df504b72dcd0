"""Celery's reconnect over kombu's Redis transport when Redis dies, as a worker's connection is
then: a task channel holding an unacknowledged message with a BRPOP outstanding, and a
broadcast channel. Deterministic here; under a running worker it depends on which socket
notices first (tests/test_batch_recovery.py)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Message, Queue

from exo_tasks.broker import close_every_channel
from tests.support.processes import Processes, start_redis, wait_until


def test_a_connection_closes_whole_when_redis_is_gone(processes: Processes, tmp_path: Path) -> None:
    close_every_channel()  # as the worker app does
    redis = start_redis(processes, tmp_path / "redis")
    connection = Connection(redis.url)
    tasks = Queue("tasks", Exchange("tasks"), "tasks")
    with connection.Producer() as producer:
        producer.publish({"n": 1}, exchange=tasks.exchange, routing_key="tasks", declare=[tasks])
    delivered: list[Message] = []
    connection.Consumer([tasks], callbacks=[lambda _, m: delivered.append(m)]).consume()
    broadcast = Queue("broadcast", Exchange("broadcast", type="fanout"), auto_delete=True)
    connection.Consumer([broadcast], channel=connection.channel()).consume()

    def drain() -> bool:
        with contextlib.suppress(TimeoutError):  # nothing came: the BRPOP stays outstanding
            connection.drain_events(timeout=0.2)
        return bool(delivered)

    wait_until(drain, 10, "the message delivered, not acknowledged")
    drain()
    task_channel: Any = connection.default_channel  # kombu's Redis channel, past its stubs
    assert task_channel._in_poll is not None
    redis.process.send_signal(signal.SIGKILL)
    redis.process.wait(timeout=5)
    # What Celery's consumer does on losing the broker (on_connection_error_after_connected):
    # collect, then close. kombu alone leaves the task channel open at collect, and the close
    # raises AttributeError ('NoneType' object has no attribute 'hostname'): the worker exits.
    connection.collect(socket_timeout=1)
    connection.close()
    assert task_channel.closed
