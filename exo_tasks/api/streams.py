"""Open event streams, cheaply: one Redis reader per API process for every stream it serves.

Each open stream (`/v1/jobs/<id>/stream`, a streamed OpenAI completion, a non-streamed one
waiting for its job) subscribes to its job's events here instead of holding a Redis connection
in a blocking XREAD of its own. One reader (a thread; a greenlet under gunicorn's gevent
worker) reads every subscribed job's stream with one XREAD and hands each event to the
subscribers of that job, so the Redis connections of an API process do not grow with its
streams. Each subscriber buffers at most EXO_STREAM_BUFFER_EVENTS events: one whose client
reads slower than its job generates is cut off (`StreamOverflow`) instead of growing without
bound, and the runner never waits for anyone. `StreamCap` counts open streams against
EXO_MAX_STREAMS.

A stream that joins while the reader waits in its XREAD wakes it: an entry in the hub's own
wake stream, which every XREAD reads too (one write per read at most, however many streams
join meanwhile). Without it a new stream's events waited for the read's slice to end: a
1-token job took ~200 ms end to end, ~190 of them here.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import TypeAdapter

from exo_tasks.errors import StreamsFull
from exo_tasks.store import Store, events_key, hub_wake_key
from exo_tasks.types import DoneEvent, JobEvent

log = logging.getLogger("exo_tasks.api.streams")
_event_adapter: TypeAdapter[JobEvent] = TypeAdapter(JobEvent)

# The reader's XREAD waits this long for any event (a stream that joins meanwhile wakes it).
READ_SLICE_MS = 200
# The wake stream of a process that died goes with it: each wake renews this.
WAKE_TTL_S = 3600
# Entries taken per stream and read: one reply stays small even when many jobs run.
READ_COUNT = 256
# While events flow, each XREAD returns at once and names every open stream's job again: reads
# are spaced by this much per stream read (at most MAX_READ_GAP_S), so that a few thousand
# streams cost Redis and this process a bounded number of key reads per second, at the price
# of events arriving in slightly larger bunches.
READ_GAP_PER_STREAM_S = 50e-6
MAX_READ_GAP_S = 0.1
STREAMS_FULL_RETRY_AFTER_S = 1
# A stream with nothing to send writes a keepalive this often: a client gone without a FIN is
# noticed by the write that the kernel gives up on (see gunicorn_worker.py).
KEEPALIVE_S = 1.0
Entry = tuple[str, JobEvent]


def stream_id(raw: str) -> tuple[int, int]:
    """A Redis stream id as a comparable pair (a bare millisecond count means sequence 0)."""
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


class StreamOverflow(Exception):
    """A stream's client fell EXO_STREAM_BUFFER_EVENTS events behind its job."""


@dataclass(eq=False)
class Subscription:
    """One stream's view of its job's events: those after `last`, buffered up to `limit`."""

    job_id: str
    last: tuple[int, int]
    limit: int
    lock: threading.Lock
    on_overflow: Callable[[], None] = lambda: None
    items: deque[Entry] = field(default_factory=deque)
    overflowed: bool = False
    ready: threading.Event = field(default_factory=threading.Event)

    def offer(self, entry_id: str, event: JobEvent) -> None:
        """Called by the reader, under the hub's lock. An event seen already is dropped."""
        position = stream_id(entry_id)
        if position <= self.last or self.overflowed:
            return
        self.last = position
        if len(self.items) >= self.limit:
            self.overflowed = True
            self.items.clear()  # the stream ends: its backlog is of no use to anyone
            self.on_overflow()
        else:
            self.items.append((entry_id, event))
        self.ready.set()

    def take(self, timeout_s: float) -> list[Entry]:
        """The events buffered so far, waiting up to `timeout_s` for one; [] if none came."""
        self.ready.wait(timeout_s)
        with self.lock:
            taken = list(self.items)
            self.items.clear()
            self.ready.clear()
            if self.overflowed:
                raise StreamOverflow(
                    f"the client fell {self.limit} events behind the job (EXO_STREAM_BUFFER_EVENTS)"
                )
        return taken


class EventHub:
    """The one reader of an API process, and the subscriptions it feeds."""

    def __init__(
        self, connect: Callable[[], redis.Redis], buffer_events: int, waker: redis.Redis
    ) -> None:
        """`connect`: the reader's own connection; `waker`: the process's shared client, which
        writes the wakes (the reader's connection is the one waiting)."""
        self._connect = connect
        self.buffer_events = buffer_events
        self._waker = waker
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[Subscription]] = {}
        self._cursors: dict[str, str] = {}  # job id → the last stream id read for it
        self._wake = threading.Event()
        self._reader: threading.Thread | None = None
        self._wake_key = hub_wake_key(uuid.uuid4().hex)
        self._wake_cursor = "0-0"
        self._reading = False  # the reader waits in an XREAD of the streams it last took
        self._woken = False  # a wake is written for that XREAD

    @property
    def subscribed_jobs(self) -> int:
        return len(self._subscribers)

    @contextlib.contextmanager
    def subscribe(
        self, job_id: str, after: str, on_overflow: Callable[[], None] = lambda: None
    ) -> Iterator[Subscription]:
        """Events of the job after stream id `after`, for as long as the block lasts.
        `on_overflow` is called (by the reader) when the subscriber falls too far behind."""
        sub = Subscription(job_id, stream_id(after), self.buffer_events, self._lock, on_overflow)
        with self._lock:
            self._subscribers.setdefault(job_id, set()).add(sub)
            cursor = self._cursors.get(job_id)
            # Reading again from an earlier point is harmless: subscribers drop repeats.
            if cursor is None or stream_id(after) < stream_id(cursor):
                self._cursors[job_id] = after
            self._start_reader()
            wake_reader = self._reading and not self._woken
            self._woken = self._woken or wake_reader
        self._wake.set()
        if wake_reader:
            self._wake_read()
        try:
            yield sub
        finally:
            with self._lock:
                subscribers = self._subscribers.get(job_id, set())
                subscribers.discard(sub)
                if not subscribers:
                    self._subscribers.pop(job_id, None)
                    self._cursors.pop(job_id, None)

    def _start_reader(self) -> None:
        # Started at first use, in the process that serves (gunicorn forks after importing).
        if self._reader is None or not self._reader.is_alive():
            self._reader = threading.Thread(target=self._run, name="exo-event-hub", daemon=True)
            self._reader.start()

    def _wake_read(self) -> None:
        """Make the reader's XREAD return, so that it reads the streams that joined it."""
        try:
            with self._waker.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"wake": 1}, maxlen=1)
                pipe.expire(self._wake_key, WAKE_TTL_S)
                pipe.execute()
        except redis.RedisError as exc:  # the stream's events come at the read's end instead
            log.warning("waking the stream reader failed", extra={"error": str(exc)})

    def _run(self) -> None:
        client = self._connect()
        while True:
            with self._lock:
                jobs = {events_key(job_id): job_id for job_id in self._cursors}
                streams: dict[Any, Any] = {k: self._cursors[j] for k, j in jobs.items()}
                self._reading, self._woken = bool(streams), False
            if not streams:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            streams[self._wake_key] = self._wake_cursor
            started = time.monotonic()
            try:
                reply: Any = client.xread(streams, count=READ_COUNT, block=READ_SLICE_MS)
            except redis.RedisError:
                log.exception("reading the job streams failed; retrying in 1 s")
                time.sleep(1.0)
                continue
            for key, entries in reply or []:
                if key == self._wake_key:
                    self._wake_cursor = entries[-1][0]
                else:
                    self._dispatch(jobs[key], entries, read_from=streams[key])
            gap_s = min(MAX_READ_GAP_S, READ_GAP_PER_STREAM_S * len(streams))
            time.sleep(max(0.0, started + gap_s - time.monotonic()))

    def _dispatch(
        self, job_id: str, entries: list[tuple[str, dict[str, str]]], read_from: str
    ) -> None:
        parsed = [(entry_id, _event_adapter.validate_json(f["data"])) for entry_id, f in entries]
        with self._lock:
            if self._cursors.get(job_id) != read_from:
                # Its last stream closed meanwhile, or one joined from an earlier point and set
                # the cursor back: the next read starts there. Offered now, these events would
                # make that subscriber skip the ones between (a resumed stream lost tokens).
                return
            self._cursors[job_id] = parsed[-1][0]
            for sub in self._subscribers[job_id]:
                for entry_id, event in parsed:
                    sub.offer(entry_id, event)


class StreamCap:
    """Open streams of this process against EXO_MAX_STREAMS."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def acquire(self) -> Callable[[], None]:
        """Count one more stream, or StreamsFull (503) at once; returns its release, for the
        stream's response to call once it closes (http.sse_response's on_close)."""
        with self._lock:
            if self.open >= self.limit:
                raise StreamsFull(
                    f"this API process has {self.open} streams open, the most allowed "
                    f"(EXO_MAX_STREAMS={self.limit})",
                    retry_after_s=STREAMS_FULL_RETRY_AFTER_S,
                )
            self.open += 1
        return self._release

    def _release(self) -> None:
        with self._lock:
            self.open -= 1


def close_connection(environ: dict[str, Any]) -> Callable[[], None]:
    """What ends a request's connection at once, from any thread or greenlet: a write blocked
    on a client that stopped reading then fails, and the response is closed."""
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")

    def close() -> None:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    return close


def follow(
    hub: EventHub,
    store: Store,
    job_id: str,
    after: str = "0-0",
    on_overflow: Callable[[], None] = lambda: None,
) -> Iterator[tuple[str, JobEvent] | None]:
    """A job's events through the hub: those after stream id `after` up to its last
    (DoneEvent), None for each second without one (a keepalive). A reader that resumed past
    the end of the job's events resumes at their end: past an ended job's, it gets its last
    event again; past a running job's, what comes next (else its DoneEvent, whose id is lower
    than the one asked for, would never come, and the stream would send keepalives for ever).
    If the caller falls EXO_STREAM_BUFFER_EVENTS events behind, `on_overflow` is called at
    once (by the reader) and the caller gets StreamOverflow at its next read. Redis away (a
    failover) as it starts, it waits with keepalives, as the reader waits it out."""
    while True:
        try:
            last = store.streams.last_event(job_id)
            break
        except (redis.ConnectionError, redis.TimeoutError):
            yield None
            time.sleep(KEEPALIVE_S)
    yield from follow_from(hub, job_id, last, after, on_overflow)


def follow_from(
    hub: EventHub,
    job_id: str,
    last: Entry | None,
    after: str = "0-0",
    on_overflow: Callable[[], None] = lambda: None,
) -> Iterator[tuple[str, JobEvent] | None]:
    """As `follow`, given the last event of the job's stream (None: it has none yet) as read
    just now."""
    end = "0-0" if last is None else last[0]
    if last is not None and isinstance(last[1], DoneEvent) and stream_id(end) <= stream_id(after):
        yield last
        return
    if stream_id(end) < stream_id(after):
        after = end
    with hub.subscribe(job_id, after, on_overflow) as sub:
        while True:
            batch = sub.take(KEEPALIVE_S)
            if not batch:
                yield None
            for event_id, event in batch:
                yield event_id, event
                if isinstance(event, DoneEvent):
                    return
