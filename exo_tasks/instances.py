"""Model instances: one model split over several hosts, one rank runner on each. Pure (no Redis,
no MLX): the records every process shares, the instance's state machine as data, its id.
exo_tasks.store.instances keeps them in Redis, exo_tasks.instance_service places and stops
them, and each host's supervisor runs the ranks its host is named for.

    Pending ──▶ Starting ──▶ Ready ──▶ ShuttingDown ──▶ Shutdown
       │  (its hosts live,     (every rank    │  (warm: drained; hard: at once)
       │   ranks loading)      serving)       │
       └──▶ Failed (any live status; `error` names the rank, the host and the exit cause)
    Failed | Shutdown ──placed again / its hosts live again──▶ Pending (generation + 1)
    Pending ──shutdown──▶ Shutdown (no rank runs yet: a supervisor moves the instance to
                          Starting, compare-and-set, before it starts a rank)
    ShuttingDown (warm) ──shutdown hard──▶ ShuttingDown (hard)

Every (re)start bumps the record's `generation`, so a rank of an older start (its writes, its
published address) is recognised and ignored.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints, ValidationError

from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.naming import (
    INSTANCE_ID_PREFIX,
    INSTANCES_FORMAT,
    instance_runner_id,
    model_slug,
)
from exo_tasks.types import utcnow
from exo_tasks.wire import WireModel

Parallel = Literal["tensor", "pipeline"]
ShutdownMode = Literal["warm", "hard"]


class InstanceStatus(enum.StrEnum):
    PENDING = "Pending"  # placed, waiting for its hosts
    STARTING = "Starting"  # ranks loading and connecting
    READY = "Ready"
    SHUTTING_DOWN = "ShuttingDown"
    SHUTDOWN = "Shutdown"
    FAILED = "Failed"

    @property
    def is_final(self) -> bool:
        return self in (InstanceStatus.SHUTDOWN, InstanceStatus.FAILED)


PENDING, STARTING, READY = InstanceStatus.PENDING, InstanceStatus.STARTING, InstanceStatus.READY
SHUTTING_DOWN, SHUTDOWN = InstanceStatus.SHUTTING_DOWN, InstanceStatus.SHUTDOWN
FAILED = InstanceStatus.FAILED

# Every move an instance may make: status → the statuses it may move to.
INSTANCE_TRANSITIONS: dict[InstanceStatus, frozenset[InstanceStatus]] = {
    PENDING: frozenset({STARTING, SHUTDOWN, FAILED}),
    STARTING: frozenset({READY, SHUTTING_DOWN, FAILED}),
    READY: frozenset({SHUTTING_DOWN, FAILED}),
    # ShuttingDown → ShuttingDown: a warm shutdown made hard.
    SHUTTING_DOWN: frozenset({SHUTTING_DOWN, SHUTDOWN, FAILED}),
    SHUTDOWN: frozenset({PENDING}),
    FAILED: frozenset({PENDING}),
}
LIVE: tuple[InstanceStatus, ...] = tuple(s for s in InstanceStatus if not s.is_final)


def may_move(current: InstanceStatus, to: InstanceStatus) -> bool:
    return to in INSTANCE_TRANSITIONS[current]


def allowed_from(to: InstanceStatus) -> tuple[InstanceStatus, ...]:
    """The statuses from which an instance may move to `to`, in the table's order."""
    return tuple(s for s, targets in INSTANCE_TRANSITIONS.items() if to in targets)


def _unique(hosts: list[str]) -> list[str]:
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise ValueError(f"host '{host}' is listed twice: each rank needs a host of its own")
        seen.add(host)
    return hosts


# A host name as EXO_HOSTNAME gives it; no separator of EXO_INSTANCES.
HostName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[^\s,;@]+$")]


class InstanceRequest(WireModel):
    """POST /v1/instances, and each entry of EXO_INSTANCES."""

    # No control character: a NUL made the path checks raise (500).
    model: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="A model path, hub id or slug.",
    )
    hosts: Annotated[list[HostName], AfterValidator(_unique)] = Field(
        min_length=2, max_length=64, description="The hosts in rank order: rank 0 first."
    )
    parallel: Parallel = Field("tensor", description="How the model is split over the ranks.")


class InstanceShutdownBody(WireModel):
    mode: ShutdownMode = "warm"


class RankRecord(BaseModel):
    """One rank of an instance: where it runs and how its runner is doing."""

    rank: int
    host: str
    runner_id: str
    pid: int | None = None
    status: RunnerStatus = RunnerStatus.WAITING_FOR_MODEL
    address: str | None = Field(None, description="Where the rank listens for its ring peers.")
    port: int | None = None
    weights_bytes: int | None = Field(None, description="Bytes of parameters this rank holds.")
    error: str | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class InstanceRecord(BaseModel):
    """An instance as kept in Redis and shown by GET /v1/instances."""

    id: str
    model: str = Field(description="The model's slug: the name jobs and /v1/models use.")
    model_path: str = Field(
        description="What each rank loads: a path (the same on every host) or a hub id."
    )
    hosts: list[str] = Field(description="Rank order: rank 0 takes the jobs.")
    parallel: Parallel
    status: InstanceStatus = PENDING
    error: str | None = Field(None, description="Why it failed: the rank, host and exit cause.")
    shutdown_mode: ShutdownMode | None = None
    ranks: list[RankRecord]
    generation: int = Field(1, description="Bumped on every (re)start.")
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    @classmethod
    def placed(cls, model_path: str, hosts: list[str], parallel: Parallel) -> InstanceRecord:
        """A new instance of the model at `model_path`, Pending."""
        model = model_slug(model_path)
        instance_id = instance_id_for(model, hosts, parallel)
        return cls(
            id=instance_id,
            model=model,
            model_path=model_path,
            hosts=hosts,
            parallel=parallel,
            ranks=fresh_ranks(instance_id, hosts),
        )

    @property
    def rank0_host(self) -> str:
        return self.hosts[0]


def instance_id_for(model: str, hosts: list[str], parallel: Parallel) -> str:
    """Deterministic: every worker that places the same EXO_INSTANCES entry names one instance."""
    digest = hashlib.sha256("\n".join([model, ",".join(hosts), parallel]).encode()).hexdigest()
    return f"{INSTANCE_ID_PREFIX}{model}-{digest[:8]}"


def fresh_ranks(instance_id: str, hosts: list[str]) -> list[RankRecord]:
    return [
        RankRecord(rank=rank, host=host, runner_id=instance_runner_id(instance_id, rank))
        for rank, host in enumerate(hosts)
    ]


# --- moves, which the store executes with one compare-and-set ---


class IllegalMove(ValueError):
    """The instance's status does not allow the move (the API answers 409)."""

    def __init__(self, record: InstanceRecord, to: InstanceStatus, why: str = "") -> None:
        self.status, self.to = record.status, to
        super().__init__(why or f"instance '{record.id}' is {record.status}: it cannot be {to}")


@dataclass(frozen=True)
class InstanceMove:
    """Write `record` if the stored instance is in one of `allowed_from` and still of
    `generation` (the one the move was made from)."""

    record: InstanceRecord
    allowed_from: tuple[InstanceStatus, ...]
    generation: int


def move(
    record: InstanceRecord,
    to: InstanceStatus,
    *,
    error: str | None = None,
    shutdown_mode: ShutdownMode | None = None,
) -> InstanceMove:
    """`record` moved to `to`, if the table allows it from its status (else IllegalMove).
    Pending starts a new generation with fresh ranks; Failed keeps `error`."""
    if not may_move(record.status, to):
        raise IllegalMove(record, to)
    update: dict[str, object] = {"status": to, "updated_at": utcnow(), "error": error}
    if to is PENDING:
        update |= {
            "generation": record.generation + 1,
            "ranks": fresh_ranks(record.id, record.hosts),
            "shutdown_mode": None,
        }
    elif to in (SHUTTING_DOWN, SHUTDOWN):
        update["shutdown_mode"] = shutdown_mode or record.shutdown_mode
    return InstanceMove(record.model_copy(update=update), allowed_from(to), record.generation)


def shutdown(record: InstanceRecord, mode: ShutdownMode) -> InstanceMove:
    """The API's stop: a Pending instance (no rank runs) is Shutdown at once; a Starting or
    Ready one is ShuttingDown with `mode` for its supervisors to act on; a warm shutdown can be
    made hard. Anything else: IllegalMove."""
    if record.status is PENDING:
        return move(record, SHUTDOWN, shutdown_mode=mode)
    made_hard = mode == "hard" and record.shutdown_mode == "warm"
    if record.status is SHUTTING_DOWN and not made_hard:
        raise IllegalMove(
            record,
            SHUTTING_DOWN,
            f"instance '{record.id}' is already shutting down ({record.shutdown_mode})",
        )
    if record.status.is_final:
        raise IllegalMove(record, SHUTTING_DOWN, f"instance '{record.id}' is {record.status}")
    # Only from the status it was read in: a warm shutdown made hard must not undo a hard one.
    made = move(record, SHUTTING_DOWN, shutdown_mode=mode)
    return InstanceMove(made.record, (record.status,), made.generation)


# --- EXO_INSTANCES ---


def parse_instances(spec: str) -> list[InstanceRequest]:
    """The instances EXO_INSTANCES names, e.g. `/models/big@mac-a,mac-b;org/llm@a,b,c,d:tensor`
    (ValueError naming the entry)."""
    found = []
    for entry in (part.strip() for part in spec.split(";")):
        if not entry:
            continue
        model, at, placement = entry.rpartition("@")
        hosts, colon, parallel = placement.partition(":")
        body: dict[str, object] = {
            "model": model.strip(),
            "hosts": [h.strip() for h in hosts.split(",")],
        }
        if colon:
            body["parallel"] = parallel.strip()
        if not at:
            raise ValueError(f"EXO_INSTANCES entry '{entry}': expected {INSTANCES_FORMAT}")
        try:
            found.append(InstanceRequest.model_validate(body))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
            )
            raise ValueError(f"EXO_INSTANCES entry '{entry}': {problems}") from None
    return found
