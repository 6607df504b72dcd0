"""A runner's step writes (its jobs' tokens and endings, the metrics observed with them, and the
runner's state when its jobs came or went), sent to Redis by a thread of their own while the
batch computes its next step: written by the loop's own thread, they took a fifth of each
decode step (`tiny`, one job, a 2-core CPU).

The writes keep their order: the thread takes every step waiting and writes them as one
(`write_step`: one transaction, a job's tokens before its end). A write Redis refused is kept,
in front of the steps that came after it, and tried again only when the runner asks (`drain`,
once `failed` says so), which raises if it fails again: while Redis is down the runner waits and
steps no further, as when it wrote its steps itself.

A write that failed may have landed all the same: Redis applied it and then the connection
dropped before its reply (a master killed, a failover), and its replica has it. Each write
carries a mark, written with it; a failed one is looked up by its mark before it is sent again,
so its tokens are never in a job's stream twice.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from exo_tasks import metrics
from exo_tasks.store.client import PipelineWrite
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.types import JobRecord, TokenEvent


class StepWrites(Protocol):
    def write_step(
        self,
        runner_id: str,
        tokens: list[tuple[str, TokenEvent]],
        observations: metrics.Observations,
        endings: list[JobRecord],
        hints: list[PrefixHint],
        mark: str,
        after: Sequence[PipelineWrite] = (),
    ) -> None: ...

    def step_written(self, runner_id: str, mark: str) -> bool: ...


@dataclass
class Step:
    """What one or more steps owe Redis, in order."""

    tokens: list[tuple[str, TokenEvent]] = field(default_factory=list)
    observations: metrics.Observations = field(default_factory=metrics.Observations)
    endings: list[JobRecord] = field(default_factory=list)
    hints: list[PrefixHint] = field(default_factory=list)  # what its succeeded jobs left cached
    after: list[PipelineWrite] = field(default_factory=list)  # the runner's state, after its jobs
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    def then(self, later: Step) -> Step:
        """This step's writes followed by `later`'s, as one."""
        self.tokens += later.tokens
        self.observations.absorb(later.observations)
        self.endings += later.endings
        self.hints += later.hints
        self.after += later.after
        return self


class StepWriter:
    def __init__(self, jobs: StepWrites, runner_id: str) -> None:
        self.jobs = jobs
        self.runner_id = runner_id
        self._waiting: Step | None = None  # handed over, not yet taken by the thread
        self._failed: Step | None = None  # written once and failed: it may have landed
        self._writing = False
        self._failure: Exception | None = None  # the last write's, until tried again
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, step: Step) -> None:
        """Hand a step's writes over to the thread."""
        with self._changed:
            self._waiting = step if self._waiting is None else self._waiting.then(step)
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-writer", daemon=True)
            self._thread.start()

    def failed(self) -> bool:
        """Whether the last write failed (`drain` tries it again); at once."""
        with self._changed:
            return self._failure is not None

    def drain(self) -> None:
        """Wait until every step handed over is in Redis (what must follow them, such as a
        job's requeue, goes after). A refused write is tried again; raises if it fails again,
        its steps kept."""
        with self._changed:
            self._failure = None
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._failure is not None or self._idle())
            failure = self._failure
        if failure is not None:
            raise failure

    def _idle(self) -> bool:
        return self._waiting is None and self._failed is None and not self._writing

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._failure is None and not self._idle())
                # A failed write goes again alone, before the later ones: it alone may have landed.
                retry, step = self._failed is not None, self._failed or self._waiting
                if not retry:
                    self._waiting = None
                self._writing = True
            assert step is not None
            failure = self._write(step, retry)
            with self._changed:
                self._writing = False
                self._failed = step if failure is not None else None
                self._failure = failure
                self._changed.notify_all()

    def _write(self, step: Step, retry: bool) -> Exception | None:
        try:
            if retry and self.jobs.step_written(self.runner_id, step.mark):
                return None  # it landed; only its reply was lost
            args = (step.tokens, step.observations, step.endings, step.hints, step.mark)
            self.jobs.write_step(self.runner_id, *args, after=step.after)
        except Exception as exc:  # noqa: BLE001 (raised on the loop's thread at its next drain)
            return exc
        return None
