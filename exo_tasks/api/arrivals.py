"""First bytes before jobs: a burst of streamed completions gets its first bytes out before any
of its jobs is submitted.

A streamed completion's first byte (a keepalive comment) goes out before its job is submitted
(see openai._stream). When thousands arrive at once, the first jobs submitted start their
runner, which on a host that runs both takes its share of the CPU from the requests still
waiting for their first byte: measured on 2 cores at 2,000 streams, the first byte's p99 (from
the request sent) went from ~1 s with the runner idle to 3.5-5 s with it decoding. So a
streamed job's submission waits until no API process of the host has had a completion request
between its arrival and its answer for QUIET_S, or for MAX_WAIT_S at most: under a load that
never quiets, each job starts that much later and no later. At any steady rate the door is
empty nearly all the time and a submission goes at once.

A request that finds every door quiet as it arrives, or idle (no request on its way in and no
stream open: a client's next request after its last stream ended), and that no other request
follows before its job is sent, is no burst: its job goes at once, without waiting QUIET_S for
a burst that never comes. Measured: that wait added 10-15 ms to every lone streamed
completion's first token (a 1-token job of the `tiny` model: 26 ms against 12 through
`POST /v1/jobs`), and a client that streams one completion after another still waited for most
of QUIET_S from its last one's first byte (7.9 ms of queue overhead against 5.5 through
`POST /v1/jobs`). A burst's first request may so start its job before the burst is in; the
others wait as before: a burst's streams are open while its requests come in.

The API processes of a host share one Board, a page of memory gunicorn's master makes before
it forks them: each process's door has a seat there. Measured: with a door per process, the
first process through its share of a burst started the runner, and the other's first bytes
came 1-3 s later.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# A burst's requests reach their route one after another, not all at once: the door empties
# for moments between them. Measured: a submission let through at the first empty moment
# started the runner mid-burst; one that waits for QUIET_S of emptiness did not.
QUIET_S = 0.01
MAX_WAIT_S = 5.0
# How often the one watcher of a process looks at the doors while submissions wait for them.
WATCH_S = 0.005
BUSY = float("inf")
# Per seat: when its door is quiet (time.monotonic, host-wide), how many requests have arrived
# at it, and how many of its streams are open. Each seat is written by its own process alone.
_SEAT = struct.Struct("dQq")


class Board:
    """When each API process's door is quiet, and how many requests each has seen arrive, in
    memory shared with the processes forked after it was made. A free seat reads 0: quiet
    since ever."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self._memory = mmap.mmap(-1, seats * _SEAT.size)  # anonymous, shared on fork

    def publish(
        self, seat: int, quiet_from: float | None, *, arrived: int = 0, opened: int = 0
    ) -> None:
        """The seat's door quiet from `quiet_from` (None: as it was), with `arrived` more
        requests than before and `opened` more streams open (fewer if negative)."""
        was_quiet_from, before, open_before = _SEAT.unpack_from(self._memory, seat * _SEAT.size)
        quiet_from = was_quiet_from if quiet_from is None else quiet_from
        packed = (quiet_from, before + arrived, open_before + opened)
        _SEAT.pack_into(self._memory, seat * _SEAT.size, *packed)

    def free(self, seat: int) -> None:
        """The seat quiet since ever and with no stream open (its arrivals stay counted)."""
        _, before, _ = _SEAT.unpack_from(self._memory, seat * _SEAT.size)
        _SEAT.pack_into(self._memory, seat * _SEAT.size, 0.0, before, 0)

    def quiet_from(self) -> float:
        """When every door is quiet: the latest of the seats."""
        latest: float = max(quiet_from for quiet_from, _, _ in _SEAT.iter_unpack(self._memory))
        return latest

    def arrived(self) -> int:
        """How many requests have arrived at the host's doors."""
        return sum(count for _, count, _ in _SEAT.iter_unpack(self._memory))

    def streams_open(self) -> int:
        """How many streams the host's API processes have open."""
        return sum(count for _, _, count in _SEAT.iter_unpack(self._memory))


class Seating:
    """Gunicorn's master side of a board: a seat for each worker it forks, freed when the
    worker exits however (a SIGKILLed worker's door, busy forever, would hold every job). A
    worker forked when every seat is taken (workers added by TTIN) keeps a door of its own."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self._taken: set[int] = set()

    def seat(self) -> int | None:
        free = next((s for s in range(self.board.seats) if s not in self._taken), None)
        if free is not None:
            self._taken.add(free)
            self.board.free(free)
        return free

    def free(self, seat: int | None) -> None:
        if seat is not None:
            self._taken.discard(seat)
            self.board.free(seat)


# This process's seat on its host's board (StreamingWorker.init_process), if it has one.
_shared_seat: tuple[Board, int] | None = None


def take_seat(board: Board, seat: int) -> None:
    global _shared_seat
    _shared_seat = (board, seat)


@dataclass(frozen=True)
class Passage:
    """One request's way through the door: whether every door was quiet or idle as it
    arrived (Arrivals.idle), and the host's count of arrivals with it."""

    into_quiet: bool
    arrivals: int


class Arrivals:
    """The completion requests of this process between their arrival and their answer, and
    the submissions waiting for the doors of the host. Threads and greenlets alike (gevent
    patches threading: a waiting submission is a greenlet parked on an event, woken by one
    watcher). Outside gunicorn (tests, a single process) the board is this process's own."""

    def __init__(
        self, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.quiet_s = quiet_s
        self._clock = clock
        self._board, self._seat = _shared_seat or (Board(seats=1), 0)
        self._lock = threading.Lock()
        self._arriving = 0
        self._board.publish(self._seat, clock())
        self._waiters = 0
        self._watching = False
        # Set by the watcher once the doors are quiet, cleared by each submission that finds
        # them busy again before it waits (a request may have arrived at any process since).
        self._quiet = threading.Event()

    @contextlib.contextmanager
    def arriving(self) -> Iterator[Passage]:
        """A request on its way to its answer (for a stream: to its first byte)."""
        with self._lock:
            # Counted before the doors are looked at: one that arrives between the two is seen.
            before = self._board.arrived()
            passage = Passage(into_quiet=self.quiet() or self.idle(), arrivals=before + 1)
            self._arriving += 1
            self._board.publish(self._seat, BUSY, arrived=1)
        try:
            yield passage
        finally:
            with self._lock:
                self._arriving -= 1
                if self._arriving == 0:
                    self._board.publish(self._seat, self._clock() + self.quiet_s)

    def quiet(self) -> bool:
        """Whether no request has been arriving, at any door of the host, for quiet_s."""
        return self._board.quiet_from() <= self._clock()

    def idle(self) -> bool:
        """Whether no request is on its way in at any door of the host, and no stream open."""
        return self._board.quiet_from() != BUSY and self._board.streams_open() == 0

    def stream_opened(self) -> Callable[[], None]:
        """Count a stream open until the function returned is called, once, as the stream's
        response closes (http.sse_response's on_close)."""
        with self._lock:
            self._board.publish(self._seat, None, opened=1)
        return self._stream_closed

    def _stream_closed(self) -> None:
        with self._lock:
            self._board.publish(self._seat, None, opened=-1)

    def alone(self, passage: Passage) -> bool:
        """Whether the request of `passage` came to quiet doors and nobody has come since."""
        return passage.into_quiet and self._board.arrived() == passage.arrivals

    def wait_until_quiet(
        self, timeout_s: float = MAX_WAIT_S, passage: Passage | None = None
    ) -> None:
        """Return once quiet(), or at once for the job of a request alone (`passage`), or after
        timeout_s."""
        if timeout_s <= 0 or self.quiet() or (passage is not None and self.alone(passage)):
            return
        with self._lock:
            self._quiet.clear()
            self._waiters += 1
            start_watcher = not self._watching
            self._watching = True
        if start_watcher:
            threading.Thread(target=self._watch, name="exo-arrivals", daemon=True).start()
        try:
            self._quiet.wait(timeout_s)
        finally:
            with self._lock:
                self._waiters -= 1

    def _watch(self) -> None:
        """Opens the door to the waiting submissions once it is quiet; ends with the last."""
        while True:
            with self._lock:
                if self._waiters == 0:
                    self._watching = False
                    return
            if self.quiet():
                self._quiet.set()
            time.sleep(WATCH_S)
