"""No batch input stops the batch feeder: each hostile batch ends in a definite state with its
reason while a bystander batch started after it completes whole. Before, a lone surrogate, a
byte order mark, 300 levels of nesting or a deleted input file raised in the feeder's tick,
every tick (a traceback ten times a second), and every batch stopped for good. A stack of its
own (Redis, a worker whose feeder is the only one, the API), so that its log is this module's
and a wedged feeder wedges no other test's batches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Batch

from config.settings import Settings
from exo_tasks.store import Store
from exo_tasks.store.keys import batch_key
from tests.support.api import Api, api_settings, serving
from tests.support.batches import chat_line, jsonl, read_file, start, wait_status
from tests.support.clients import client_for
from tests.support.processes import Processes, start_redis, wait_until
from tests.support.workers import Worker, new_worker

ENDED = {"completed", "failed", "cancelled", "expired"}
# A batch's lines in flight on the worker's one host, at its defaults (its pool children less 2
# are as many).
IN_FLIGHT = Settings().batch_inflight_per_host


@dataclass
class Feeding:
    api: Api
    client: openai.OpenAI
    store: Store
    worker: Worker


@pytest.fixture(scope="module")
def feeding(
    module_processes: Processes, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Feeding]:
    data_dir = tmp_path_factory.mktemp("batch-hostile")
    redis = start_redis(module_processes, data_dir / "redis")
    store = Store.from_url(redis.url)
    worker = new_worker(module_processes, redis.url, store, "bh-1", [tiny_model], data_dir)
    with serving(api_settings(redis.url, [tiny_model])) as api, client_for(api) as client:
        yield Feeding(api, client, store, worker)


@pytest.fixture
def bystander(feeding: Feeding) -> Iterator[None]:
    """Started after the hostile batch (the test's body starts that first), it must complete
    whole, and the hostile one must cost the worker's log at most a traceback or two."""
    tracebacks = tracebacks_in(feeding.worker)
    lines = [chat_line(f"b{i}", f"bystander {i}", max_tokens=16) for i in range(6)]
    yield
    batch = wait_status(feeding.client, start(feeding.client, lines).id, ENDED, 60)
    assert batch.status == "completed", batch
    output = read_file(feeding.client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"b{i}" for i in range(6)]
    assert tracebacks_in(feeding.worker) - tracebacks <= 2


def tracebacks_in(worker: Worker) -> int:
    """Tracebacks logged on lines of their own (Celery's `Task ... ignored` for a cancelled
    job carries one inside its line: not ours)."""
    return sum(line.startswith("Traceback") for line in worker.log_text().splitlines())


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def raw_line(custom_id: str, body: str) -> str:
    """A line whose body is given as JSON text (json.dumps cannot write a lone surrogate)."""
    head = json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"})
    return head[:-1] + f', "body": {body}}}'


def surrogate_body(field: str) -> str:
    message = {"role": "user", "content": "hi"}
    text = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [message]})
    return text.replace('"hi"', '"\\ud800"') if field == "content" else text


SURROGATE = raw_line("surrogate", surrogate_body("content"))
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"a": "DEEP"}}}
DEEP_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
DEEP = raw_line("deep", json.dumps(DEEP_BODY).replace('"DEEP"', nested(300)))


def only_errors(client: openai.OpenAI, batch: Batch) -> dict[str, dict[str, Any]]:
    return {line["custom_id"]: line for line in read_file(client, batch.error_file_id)}


@pytest.mark.usefixtures("bystander")
@pytest.mark.parametrize(
    ("hostile", "param", "says"),
    [
        (SURROGATE, "messages.0.content", "lone UTF-16 surrogate"),
        (DEEP, None, "nested too deeply"),
    ],
    ids=["lone-surrogate", "300-deep"],
)
def test_a_body_no_endpoint_takes_is_its_lines_error(
    feeding: Feeding, hostile: str, param: str | None, says: str
) -> None:
    client = feeding.client
    batch = start(client, [chat_line("good", "hi"), hostile, chat_line("after", "hi")])
    ended = wait_status(client, batch.id, ENDED, 60)
    assert ended.status == "completed", ended
    assert ended.request_counts is not None
    assert (ended.request_counts.completed, ended.request_counts.failed) == (2, 1)
    output = read_file(client, ended.output_file_id)
    assert [line["custom_id"] for line in output] == ["good", "after"]
    (refused,) = only_errors(client, ended).values()
    # The answer the endpoint gives the same body sent directly.
    assert refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["param"] == param and says in error["message"]
    body = hostile[hostile.index('"body": ') + len('"body": ') : -1]
    direct = feeding.api.post(
        "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    assert direct.status_code == 400 and direct.json()["error"]["message"] == error["message"]


@pytest.mark.usefixtures("bystander")
def test_a_file_saved_with_a_byte_order_mark_runs(feeding: Feeding) -> None:
    content = "\ufeff".encode() + jsonl([chat_line("first", "hi"), chat_line("second", "hi")])
    uploaded = feeding.client.files.create(file=("bom.jsonl", content), purpose="batch")
    batch = feeding.client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = wait_status(feeding.client, batch.id, ENDED, 60)
    assert ended.status == "completed", ended
    output = read_file(feeding.client, ended.output_file_id)
    assert [line["custom_id"] for line in output] == ["first", "second"]


def long_batch(client: openai.OpenAI, count: int = 60) -> Batch:
    """A batch that runs for a while: its lines wait for room (IN_FLIGHT jobs at once)."""
    lines = [chat_line(f"l{i}", "go", max_tokens=60, ignore_eos=True) for i in range(count)]
    batch = start(client, lines)
    wait_status(client, batch.id, {"in_progress"}, 30)
    return batch


@pytest.mark.usefixtures("bystander")
def test_the_input_of_a_running_batch_cannot_be_deleted(feeding: Feeding) -> None:
    client = feeding.client
    batch = long_batch(client)
    refused = feeding.api.http.delete(f"{feeding.api.url}/v1/files/{batch.input_file_id}")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["param"] == "file_id" and batch.id in error["message"]
    assert client.files.content(batch.input_file_id).content  # still there
    client.batches.cancel(batch.id)
    assert wait_status(client, batch.id, ENDED, 10).status == "cancelled"
    assert client.files.delete(batch.input_file_id).deleted  # once the batch has ended


@pytest.mark.usefixtures("bystander")
def test_a_batch_whose_input_goes_anyway_fails_alone_with_the_reason(feeding: Feeding) -> None:
    """The file deleted behind the API's back (or between its check and its delete)."""
    client = feeding.client
    batch = long_batch(client)
    wait_until(lambda: feeding.store.batches.inflight(batch.id), 30, "lines in flight")
    assert feeding.store.files.delete(batch.input_file_id)
    ended = wait_status(client, batch.id, ENDED, 10)
    assert ended.status == "failed", ended
    assert ended.errors is not None and ended.errors.data is not None
    (reason,) = ended.errors.data
    assert reason.code == "batch_failed"
    assert reason.message == f"its input file '{batch.input_file_id}' was deleted while it ran"
    assert ended.request_counts is not None and ended.request_counts.total == 60
    done = read_file(client, ended.output_file_id) + read_file(client, ended.error_file_id)
    assert len(done) == ended.request_counts.completed + ended.request_counts.failed


@pytest.mark.usefixtures("bystander")
def test_a_step_that_raises_fails_its_batch_alone_and_cancel_ends_it(feeding: Feeding) -> None:
    """Whatever raises inside one batch's step (here its kept line positions, corrupted) ends
    that batch `failed`, naming the error; a cancel always ends a batch."""
    client = feeding.client
    spans = feeding.store.redis
    broken = long_batch(client)
    spans.lset(batch_key(broken.id, "spans"), 59, "not a span")
    ended = wait_status(client, broken.id, ENDED, 60)
    assert ended.status == "failed", ended
    assert ended.errors is not None and ended.errors.data is not None
    assert "ValueError" in str(ended.errors.data[0].message)
    # Its last line is fed once all but IN_FLIGHT lines have ended: those ran to completion.
    assert ended.request_counts is not None and ended.request_counts.completed >= 60 - IN_FLIGHT

    cancelled = long_batch(client)
    spans.lset(batch_key(cancelled.id, "spans"), 59, "not a span")
    client.batches.cancel(cancelled.id)
    ended = wait_status(client, cancelled.id, ENDED, 10)
    assert ended.status == "failed" and ended.errors is not None, ended
