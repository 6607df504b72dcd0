"""The tasks of jobs handed over directly, until they are sent (exo_tasks.direct): job ids in a
sorted set, scored by when each task is due. Whoever removes an id sends its task: the API
process that handed the job over, once due, or the recovery loop, for an id no API removed (its
process stopped or died meanwhile)."""

from __future__ import annotations

from exo_tasks.store.client import RedisPart
from exo_tasks.store.keys import DIRECT_TASKS_DUE, job_key
from exo_tasks.types import JobRecord


class DirectTasks(RedisPart):
    def claim(self, job_id: str) -> tuple[bool, JobRecord | None, str | None]:
        """Take the job's task to send (False: it was taken already), with the job as it is
        now and the queue it is recorded in, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(DIRECT_TASKS_DUE, job_id)
        pipe.hmget(job_key(job_id), "record", "queue")
        removed, (raw, queue) = pipe.execute()
        return bool(removed), (JobRecord.model_validate_json(raw) if raw else None), queue

    def due_before(self, moment: float) -> list[str]:
        """The jobs whose task was due before `moment` (a Unix time) and is not sent yet."""
        ids: list[str] = self.redis.zrangebyscore(DIRECT_TASKS_DUE, "-inf", moment)
        return ids
