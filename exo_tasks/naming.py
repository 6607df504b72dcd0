"""Every name the fleet builds from another: model slugs, runner ids, queue names and Celery
node names. Pure: the API, the worker, the runners and the tests all ask here."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

NODE_PREFIX = "exo@"
MODEL_QUEUE_PREFIX = "exo.model."
HOST_QUEUE_PREFIX = "exo.host."
# EXO_INSTANCES: what exo_tasks.instances.parse_instances reads.
INSTANCES_FORMAT = "MODEL@HOST,HOST[,...][:tensor|:pipeline], entries separated by ';'"


def model_slug(model: str) -> str:
    """A queue- and URL-safe name for a model path or hub id ('mlx-community/Qwen3' → 'qwen3')."""
    name = Path(model.rstrip("/")).name or model
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"


def find_model(name: str, models: Iterable[str]) -> str | None:
    """The first of `models` (slugs) that `name` names: by itself, or by its slug (a path or a
    hub id names the model it would serve as)."""
    names = (name, model_slug(name))
    return next((model for model in models if model in names), None)


def runner_id_for(model: str, host: str) -> str:
    """A runner is named by what it serves and where: one per (model, host)."""
    return f"{model}@{host}"


def model_queue(model: str) -> str:
    """The queue of a model's jobs, consumed by every live host serving it."""
    return f"{MODEL_QUEUE_PREFIX}{model}"


def host_queue(host: str) -> str:
    """A host's own queue: jobs pinned to it, and its runner control tasks."""
    return f"{HOST_QUEUE_PREFIX}{host}"


def host_of_queue(queue: str) -> str | None:
    """The host whose own queue `queue` is; None for a model's queue."""
    return queue.removeprefix(HOST_QUEUE_PREFIX) if queue.startswith(HOST_QUEUE_PREFIX) else None


def node_name(host: str) -> str:
    """The Celery node name of a host's worker."""
    return f"{NODE_PREFIX}{host}"


INSTANCE_QUEUE_PREFIX = "exo.instance."
INSTANCE_ID_PREFIX = "inst-"
RANK_INFIX = ".rank"


def instance_queue(instance_id: str) -> str:
    """The queue of an instance's jobs, consumed only by the worker of its rank-0 host."""
    return f"{INSTANCE_QUEUE_PREFIX}{instance_id}"


def instance_of_queue(queue: str) -> str | None:
    """The instance whose queue `queue` is; None for any other queue."""
    if not queue.startswith(INSTANCE_QUEUE_PREFIX):
        return None
    return queue.removeprefix(INSTANCE_QUEUE_PREFIX)


def instance_runner_id(instance_id: str, rank: int) -> str:
    """The runner of one rank of an instance (one per host of the instance)."""
    return f"{instance_id}{RANK_INFIX}{rank}"


def instance_of_runner(runner_id: str) -> str | None:
    """The instance whose rank `runner_id` is; None for a runner of a whole model."""
    instance_id, infix, rank = runner_id.rpartition(RANK_INFIX)
    named = infix and rank.isdigit() and instance_id.startswith(INSTANCE_ID_PREFIX)
    return instance_id if named and "@" not in runner_id else None


def model_path(model: str) -> Path:
    """`model` as a path, `~` expanded. `~name` for a user this host does not have stays as
    written: no such directory, so no such model (pathlib would raise)."""
    try:
        return Path(model).expanduser()
    except RuntimeError:
        return Path(model)


def is_local_path(model: str) -> bool:
    """Whether `model` names a local path (absolute, `./`, `../`, `~`, or under an existing
    directory); anything else is a hub id for mlx-lm."""
    path = model_path(model)
    return (
        path.is_absolute()
        or model.startswith(("./", "../", "~"))
        or (len(path.parts) > 1 and path.parent.is_dir())
    )
