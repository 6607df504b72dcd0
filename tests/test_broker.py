"""kombu's Redis transport as exo_tasks patches it (exo_tasks/broker.py). Celery's reconnect
when Redis dies, as a worker's connection is then: a task channel holding an unacknowledged
message with a BRPOP outstanding, and a broadcast channel (deterministic here; under a running
worker it depends on which socket notices first: tests/test_batch_recovery.py). And the
redis-py clients kombu builds to send messages."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Message, Queue

from config.settings import Settings
from exo_tasks.broker import close_every_channel
from exo_tasks.celery_app import ExoCelery
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


def test_sending_many_messages_builds_a_redis_client_per_channel_not_per_message(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu built a redis-py client (160 µs) for every message and event it published."""
    server = start_redis(processes, tmp_path / "redis")
    app = ExoCelery(Settings(redis_url=server.url))
    built: list[int] = []
    build = redis.Redis.__init__

    def counted(client: redis.Redis, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        build(client, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counted)
    for n in range(50):  # each a task message and its task-sent event
        app.send_task("exo.nothing", args=[n], queue="broker-test")
    assert redis.Redis.from_url(server.url).llen("broker-test") == 50
    assert len(built) <= 5, len(built)  # one per channel (tasks, events), the result backend
