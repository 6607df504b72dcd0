"""The worker: one `celery worker` per host (`app`), its pool children's tasks (`tasks`,
`task_states`, `soft_limit`, `revocation`) and, in its main process, the runner supervisor
(`supervisor`, with its rules in `supervision` and the records of its runners' exits in
`runner_exits`) and the keeper of its ranks of instances (`ranks`).

It never imports Flask, `exo_tasks.api` or MLX: the runners and the batch feeder it starts are
processes of their own.
"""

__all__ = [
    "app",
    "ranks",
    "revocation",
    "runner_exits",
    "soft_limit",
    "supervision",
    "supervisor",
    "task_states",
    "tasks",
]
