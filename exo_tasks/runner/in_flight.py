"""The jobs in a runner's batch and the engine that steps them: how a job joins (admitted, or
refused with its failure written with the next step), how it leaves (ended, first writer wins;
requeued when the worker stops; expired by the runner's own clock), and the progress each move
reports to the stall watchdog. The loop that decides when each happens is
`exo_tasks.runner.loop`.
"""

from __future__ import annotations

import logging
import time

from exo_tasks import metrics, prefix_routing
from exo_tasks.commands import CheckJobs, JobCheck, SubmitJob
from exo_tasks.runner import intake
from exo_tasks.runner.active_job import ActiveJob, take_step
from exo_tasks.runner.keep_alive import KeepAlive
from exo_tasks.runner.outbox import Outbox
from exo_tasks.runner.process import Engine, RunnerProgress, RunnerSpec
from exo_tasks.store import Store, UnreadableCommand
from exo_tasks.store.hosts import PrefixHint
from exo_tasks.types import FinishReason, JobRecord, JobStatus, utcnow

log = logging.getLogger("exo_tasks.runner")


class InFlight:
    """The runner's jobs by id, and its engine while the model is loaded."""

    def __init__(
        self,
        spec: RunnerSpec,
        store: Store,
        outbox: Outbox,
        progress: RunnerProgress,
        keep_alive: KeepAlive,
    ) -> None:
        self.spec = spec
        self.store = store
        self.outbox = outbox
        self.progress = progress
        self.keep_alive = keep_alive
        self.jobs: dict[str, ActiveJob] = {}
        self.engine: Engine | None = None

    @property
    def loaded(self) -> Engine:
        """The engine, once the runner has loaded it (jobs join only then)."""
        assert self.engine is not None, "the runner's model is not loaded"
        return self.engine

    # --- joining ---

    def admit(self, command: SubmitJob) -> None:
        # Its task marked the job running as it handed it over: nothing to write to start it.
        job = command.job
        if not self._replaces_what_it_holds(job):
            return
        try:
            prompt = intake.prompt_tokens_of(self.loaded, job.request, self.spec.max_prompt_tokens)
            self.loaded.add(job.id, prompt, job.request)
        except ValueError as exc:  # the prompt's refusal, or the engine's own checks
            self.refuse(command, str(exc), its_input=True)
            return
        except Exception as exc:
            # Whatever else one job's input can raise (such as MLX refusing its seed) is that
            # job's failure, never the batching loop's.
            log.exception("job could not be admitted", extra={"job_id": job.id})
            error = f"could not start the job: {type(exc).__name__}: {exc}"
            self.refuse(command, error, its_input=False)
            return
        # Counted here; the stored record shows it once the job ends.
        usage = job.usage.model_copy(update={"prompt_tokens": len(prompt)})
        started = job.model_copy(update={"usage": usage})
        limits = (command.soft_deadline, command.deadline, self.spec.max_job_bytes)
        self.jobs[job.id] = ActiveJob(started, *limits)
        # The record's own wait (its task's hand-over), not the runner's admission: the two
        # differ by the runner's intake, which a loaded host makes long.
        self.outbox.observe(metrics.QUEUE_TIME, (job.started_at or utcnow()) - job.created_at)
        self.record_progress(progressed=True)
        log.info("job admitted", extra={"job_id": job.id, "prompt_tokens": len(prompt)})
        self.outbox.jobs_changed()

    def _replaces_what_it_holds(self, job: JobRecord) -> bool:
        """A job handed over while this runner holds it already: a runner that died with its
        inbox unread leaves its hand-overs to the next runner of its name, and the job, requeued
        meanwhile, is handed over again. Its later attempt replaces the earlier one (whose
        tokens no one follows any more); the same attempt again is dropped."""
        held = self.jobs.get(job.id)
        if held is None:
            return True
        extra = {"job_id": job.id, "attempt": job.attempts, "held": held.record.attempts}
        if job.attempts <= held.record.attempts:
            log.warning("job handed over again in an attempt held already; dropped", extra=extra)
            return False
        del self.jobs[job.id]
        self.loaded.remove(job.id)
        log.warning("job handed over in a later attempt; the earlier one dropped", extra=extra)
        return True

    def send_back(self, job_id: str) -> None:
        """A job handed over while the runner stops: never started, back to the queue."""
        self.store.runners.release_job(self.spec.runner_id, job_id)
        self.store.jobs.requeue(job_id)

    def refuse(self, command: SubmitJob, error: str, *, its_input: bool) -> None:
        """Fail a job that cannot join the batch: written with the next step's writes, and work
        done for the stall watchdog."""
        self.outbox.endings.append(intake.refusal(command.job, error, its_input=its_input))
        self.record_progress(progressed=True)

    def unreadable(self, command: UnreadableCommand) -> None:
        """A message we cannot read fails the job it names now: dropped, the job would show
        `running` until its time limits, which the message may have been unreadable for."""
        log.error("unreadable command in the inbox", extra={"job_id": command.job_id})
        if command.job_id is None:
            return
        error = f"the runner could not read the job's command: {command.error}"
        if command.job_id in self.jobs:
            self.end(command.job_id, JobStatus.FAILED, None, error)
        else:  # never joined the batch, and we do not have its record
            self.store.runners.release_job(self.spec.runner_id, command.job_id)
            self.store.jobs.fail(command.job_id, error)
            self.record_progress(progressed=True)

    # --- stepping ---

    def step(self) -> float:
        """One step of the engine, its tokens and endings into the outbox; how long it took."""
        started = time.monotonic()
        deltas = self.loaded.step()
        took_s = time.monotonic() - started
        for job_id, ending in take_step(self.jobs, deltas, self.outbox):
            self.end(job_id, *ending, in_engine=False)
        # A chunk of a long prompt prefilled is progress too: a runner busy prefilling is not hung.
        self.record_progress(progressed=bool(deltas) or self.loaded.prefill_chunks > 0)
        return took_s

    def record_progress(self, *, progressed: bool) -> None:
        awaiting = sum(job.awaiting_first_token for job in self.jobs.values())
        self.progress.record(
            active=len(self.jobs), awaiting_first_token=awaiting, progressed=progressed
        )

    # --- leaving ---

    def end(
        self,
        job_id: str,
        status: JobStatus | str,
        reason: FinishReason | None,
        error: str | None = None,
        *,
        in_engine: bool = True,
    ) -> None:
        """Take a job out of the batch and record how it ended (first writer wins). `status`:
        an ending (lifecycle.ENDINGS), by member or value."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        if in_engine:
            self.loaded.remove(job_id)
        ended = job.ended(JobStatus(status), reason, error)
        self.outbox.endings.append(ended)
        if (hint := self._prefix_hint(ended)) is not None:
            self.outbox.hints.append(hint)
        self.keep_alive.idle_from(time.monotonic(), job.record.request.keep_alive)
        log.info("job ended", extra={"job_id": job_id, "status": status, "finish_reason": reason})
        self._after_job_left()

    def _prefix_hint(self, ended: JobRecord) -> PrefixHint | None:
        """Where a succeeded job's conversation is best continued: here, whose prompt cache
        holds its prompt and answer (exo_tasks.prefix_routing). Written with the ending, so
        the next turn, sent as soon as the client has the answer, is routed by it."""
        ttl_s = self.spec.prefix_routing_ttl_s
        if ended.status != JobStatus.SUCCEEDED or ttl_s <= 0:
            return None
        digests = prefix_routing.conversation_digests(ended.request, ended.output.text)
        return PrefixHint(ended.model, digests, self.spec.host, ttl_s) if digests else None

    def end_all(self, status: JobStatus, reason: FinishReason | None, error: str | None) -> None:
        for job_id in list(self.jobs):
            self.end(job_id, status, reason, error)

    def requeue_all(self) -> None:
        """The worker is stopping: unfinished jobs go back to the queue for another attempt."""
        self.outbox.drain()  # each job's `requeued` after the tokens of the attempt it ends
        for job_id in list(self.jobs):
            del self.jobs[job_id]
            self.loaded.remove(job_id)
            self.store.jobs.requeue(job_id)
            self.store.runners.release_job(self.spec.runner_id, job_id)
            log.info("job requeued", extra={"job_id": job_id})
        self._after_job_left()

    def check(self, command: CheckJobs) -> None:
        """The recovery loop asks about the jobs the store shows running here. One we no longer
        hold has ended (or was refused, or sent back), its ending written before this answer
        (the outbox drains first), unless Redis lost that write (a master that failed over
        before its replica had it): the job is then still running in the attempt asked about,
        and goes back to the queue, to run again from the start, rather than wait for a time
        limit under a worker that no longer runs it. The inbox is one list, read in order: a
        job handed over before the question came is in `jobs` by now."""
        missing = [asked for asked in command.jobs if asked.job_id not in self.jobs]
        if not missing:
            return
        self.outbox.drain()
        for asked in missing:
            self._requeue_if_lost(asked)

    def _requeue_if_lost(self, asked: JobCheck) -> None:
        """A job asked about that we do not hold, its own endings written: back to the queue
        if it still runs in the attempt asked about."""
        job_id, attempt = asked.job_id, (asked.owner, asked.attempt)
        job = self.store.jobs.get(job_id)
        if job is None or job.is_terminal or (job.owner, job.attempts) != attempt:
            return  # ended; or a later attempt, whose hand-over may come after the question
        self.store.runners.release_job(self.spec.runner_id, job_id)
        # Requeued, or ended `cancelled` if a cancel was accepted meanwhile.
        if self.store.jobs.requeue(job_id, only_from=asked.owner, only_attempt=asked.attempt):
            why = "job requeued: running in the store, but not on its runner (its ending lost)"
            log.warning(why, extra={"job_id": job_id, "attempt": asked.attempt})

    def drop_expired(self) -> None:
        """End the jobs past their time limits by our own clock (the task's hard limit kills
        its pool child before it can tell us; the soft limit's signal can be lost), or past
        their storage bound."""
        now = time.time()
        for job_id, job in list(self.jobs.items()):
            ending = job.expiry(now) or job.over_storage()
            if ending is not None:
                self.end(job_id, *ending)

    def _after_job_left(self) -> None:
        self.record_progress(progressed=False)
        self.outbox.jobs_changed()
