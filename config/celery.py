"""The Celery configuration, built from Settings; the reasons for what is not Celery's default
are beside it."""

from __future__ import annotations

from typing import Any

from config.settings import Settings

# Redis priorities: 0 is served first, and kombu takes 0 to 9 only (it clamps the rest). Each
# class has steps of its own: a job waits at a later step of its class the more jobs its client
# already has waiting (exo_tasks.fairness), so one client's backlog does not hold back another's
# first jobs. Each class holds its old level (0, 5, 9), so messages queued before go on; "normal"
# does not start at 0 so that an unprioritised message never overtakes a "high" one.
PRIORITY_CLASSES = {"high": range(0, 3), "normal": range(3, 7), "low": range(7, 10)}
PRIORITY_LEVELS = {name: steps.start for name, steps in PRIORITY_CLASSES.items()}
PRIORITY_STEPS = list(range(10))


def celery_config(settings: Settings) -> dict[str, Any]:
    redis_url = settings.effective_redis_url
    backend_options: dict[str, Any] = {"retry_policy": {"timeout": 5.0}}
    transport_options: dict[str, Any] = {
        # Above every job's hard limit (Settings and the API check it: exo_tasks/limits.py),
        # or a long acks_late job is delivered twice (celery#5935). Only the last backstop: the
        # recovery loop requeues a dead worker's jobs long before it.
        "visibility_timeout": settings.broker_visibility_timeout_s,
        # How often a worker looks for messages whose consumer died (kombu's default is
        # every ~100 s: 10 s x a throttle of 10).
        "unacked_restore_interval": settings.broker_restore_interval_s,
        "unacked_restore_throttle": 1,
        "priority_steps": PRIORITY_STEPS,
        "queue_order_strategy": "priority",
    }
    sentinels = settings.sentinels
    if sentinels is not None:
        # kombu's `sentinel://` transport and Celery's sentinel backend: each asks the
        # Sentinels for the master whenever it connects (exo_tasks/redis_sentinel.py).
        redis_url = sentinels.kombu_url()
        transport_options.update(sentinels.transport_options())
        backend_options.update(sentinels.transport_options())
    return {
        "broker_url": redis_url,
        "result_backend": redis_url,
        "broker_transport_options": transport_options,
        "result_backend_transport_options": backend_options,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "result_expires": settings.job_ttl_s,
        # Long jobs: acknowledge after the task ran, take one message at a time; a message
        # whose pool child died goes back to its queue at once.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_priority": PRIORITY_LEVELS["normal"],
        "task_inherit_parent_priority": True,
        "task_track_started": True,
        # Flower builds its views from events.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "worker_concurrency": settings.worker_concurrency,
        "worker_pool": "prefork",
    }
