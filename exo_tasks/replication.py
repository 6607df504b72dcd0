"""Whether a replica holds what the master was given: what a 202 means behind Sentinels.

Redis replicates asynchronously. `WAIT n timeout` blocks until n replicas acknowledge the last
write *of the connection it is sent on*, and a job's record and its Celery message are written
on other connections (the store's pool, kombu's). So a probe goes first on the connection that
waits: replication is one ordered stream, and a replica that holds the probe holds every write
the master took before it. The probe is a PUBLISH to a channel no one reads: propagated to the
replicas like a write, but stored nowhere, so a full Redis (which refuses writes) takes it too.

Everything accepted waits so: a job's 202, an uploaded file, a new batch (the API), and each
round of a batch's lines before the feeder counts them in flight (docs/ha.md).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from config.settings import Settings

log = logging.getLogger("exo_tasks.replication")
PROBE_CHANNEL = "exo:replication-probe"


def wait_ms(settings: Settings) -> int:
    """How long an accepted write waits for a replica: EXO_REDIS_REPLICA_WAIT_MS behind
    Sentinels; 0 (never) with a lone Redis, which has no replica to wait for."""
    return settings.redis_replica_wait_ms if settings.sentinels else 0


def settle(client: Any, timeout_ms: int, what: str, **ids: object) -> bool:
    """Wait, at most `timeout_ms`, for a replica to hold `what` was just written (and all
    before it); False, logged as `<what> accepted on the master alone`, if none did. True at
    once when `timeout_ms` is 0 (no Sentinels)."""
    if not timeout_ms or replicated(client, timeout_ms):
        return True
    log.warning("%s accepted on the master alone", what, extra=ids)
    return False


def replicated(client: Any, timeout_ms: int) -> bool:
    """True once one replica holds every write the master took so far, False if none did
    within `timeout_ms`, at once if the master has no replica connected, or if the master
    went away meanwhile (what was written is accepted: never an error for it)."""
    try:
        _, _, replicas = client.role()
        if not replicas:
            return False
        pipe = client.pipeline(transaction=False)  # one connection: the probe, then its WAIT
        pipe.publish(PROBE_CHANNEL, "1")
        pipe.wait(1, timeout_ms)
        _, acknowledged = pipe.execute()
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    return int(acknowledged) >= 1
