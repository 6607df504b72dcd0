"""A rank of an instance, in its runner process: the port it listens on, the ring of its
instance's generation, its shard of the model, and, for every rank but 0, the loop that follows
rank 0's schedule (`exo_tasks.runner.schedule`). Rank 0 runs the ordinary batching loop
(`exo_tasks.runner.loop`) over a LeaderEngine.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from exo_tasks import lifecycle
from exo_tasks.fleet_types import RunnerStatus
from exo_tasks.instances import FAILED, STARTING
from exo_tasks.runner import ring
from exo_tasks.runner.process import (
    EXIT_CONFIG,
    ConfigError,
    Engine,
    RunnerProgress,
    RunnerSpec,
    build_engine,
    check_model_path,
    rank_failure,
)
from exo_tasks.runner.sigterm import Collectives
from exo_tasks.store import Store, redis_waits
from exo_tasks.types import utcnow

if TYPE_CHECKING:  # it imports MLX: loaded only once a rank builds its engine
    from exo_tasks.runner.engine import BatchEngine

log = logging.getLogger("exo_tasks.runner")
ADDRESS_POLL_S = 0.2
# One wait of an idle follower for rank 0's word, within the Redis client's socket timeout.
WAKE_WAIT_S = 5.0
# Exit code of a rank whose start is no longer its instance's (another generation, or the
# instance stopped before the ring formed): not a failure of its own.
EXIT_STALE = 4
# Exit code of a rank whose ring lost a peer: the instance failed elsewhere first.
EXIT_PEER_LOST = 5


class StaleStart(Exception):
    """The instance moved on (another generation, or no longer Starting) while this rank waited
    for its peers."""


def join_ring(spec: RunnerSpec, store: Store) -> Any:
    """Listen on a free port of the rank's address, publish it, wait for every rank of this
    generation to publish theirs, and join the ring; the group."""
    rank = spec.rank
    assert rank is not None
    port = ring.free_port(rank.address)
    store.instances.publish_address(
        rank.instance_id, rank.generation, rank.rank, rank.address, port
    )
    while len(found := store.instances.addresses(rank.instance_id, rank.generation)) < rank.world:
        instance = store.instances.get(rank.instance_id)
        if (
            instance is None
            or instance.generation != rank.generation
            or instance.status != STARTING
        ):
            raise StaleStart(
                f"instance {rank.instance_id} moved on from generation {rank.generation}"
            )
        time.sleep(ADDRESS_POLL_S)
    endpoints = [found[r] for r in range(rank.world)]
    log.info("joining the ring", extra={"rank": rank.rank, "endpoints": str(endpoints)})
    return ring.join(rank.rank, endpoints)


def load_shard(spec: RunnerSpec, group: Any) -> tuple[Any, Any]:
    """The rank's shard of the model (mlx-lm's sharded_load reads only what the rank holds)
    and its tokenizer."""
    from mlx_lm.utils import sharded_load

    assert spec.rank is not None
    check_model_path(spec.model_path)
    tensor = spec.rank.parallel == "tensor"
    try:
        model, tokenizer = sharded_load(
            spec.model_path,
            pipeline_group=None if tensor else group,
            tensor_group=group if tensor else None,
        )
    except ValueError as exc:  # the model cannot be split so
        raise ConfigError(f"the model cannot be split ({spec.rank.parallel}): {exc}") from exc
    return model, tokenizer


def rank_engine(spec: RunnerSpec, model: Any, tokenizer: Any) -> BatchEngine:
    """The rank's batching engine: one lane, so every rank runs its batch operations in one
    fixed order (the lanes of a single-host engine step on threads of their own)."""
    return build_engine(spec, model, tokenizer, lanes=1)


def load_leader(spec: RunnerSpec, store: Store, collectives: Collectives) -> Engine:
    """Rank 0's engine factory for the batching loop: the ring, the shard, a LeaderEngine."""
    from exo_tasks.runner.schedule import Channel, LeaderEngine

    rank = spec.rank
    assert rank is not None
    with collectives.inside():  # mlx joins the ring, and may load, in C: no handler runs
        group = join_ring(spec, store)
        model, tokenizer = load_shard(spec, group)
    followers = range(1, rank.world)
    wake = functools.partial(store.instances.wake, rank.instance_id, rank.generation, followers)
    return LeaderEngine(rank_engine(spec, model, tokenizer), Channel(group), collectives, wake)


class Follower:
    """A rank other than 0: it joins, loads its shard, then follows rank 0's plans until rank 0
    closes the instance (exit 0). Its state is published as any runner's."""

    def __init__(self, spec: RunnerSpec, progress: RunnerProgress, store: Store) -> None:
        self.spec, self.progress, self.store = spec, progress, store
        self.state = spec.first_state()
        self.engine: BatchEngine | None = None

    def publish(self, *statuses: RunnerStatus, error: str | None = None, **changes: Any) -> None:
        """Each status in turn, as the runner statuses' table allows (exo_tasks.lifecycle)."""
        for status in statuses:
            moved = lifecycle.move_runner(
                self.state, status, error=error, updated_at=utcnow(), **changes
            )
            if moved is not None:
                self.state = moved
                self.store.runners.publish(moved)

    def run(self) -> int:
        from exo_tasks.runner.schedule import Channel, follow, is_ring_error

        self.publish(RunnerStatus.LOADING)
        try:
            group = join_ring(self.spec, self.store)
            model, tokenizer = load_shard(self.spec, group)
        except StaleStart as exc:
            log.info("rank start abandoned", extra={"why": str(exc)})
            return EXIT_STALE
        except ConfigError as exc:
            self.publish(RunnerStatus.FAILED, error=str(exc))
            return EXIT_CONFIG
        self.engine = engine = rank_engine(self.spec, model, tokenizer)
        # It warms up when rank 0 does (the first plan): following is what it is ready for.
        ready = (RunnerStatus.LOADED, RunnerStatus.WARMING_UP, RunnerStatus.READY)
        memory, peak = engine.memory
        self.publish(
            *ready,
            weights_bytes=engine.weights_bytes,
            memory_bytes=memory,
            peak_memory_bytes=peak,
        )
        try:
            follow(engine, Channel(group), self._stepping, self._stepped, self._rest)
        except Exception as exc:
            log.exception("rank failed while following rank 0")
            self.publish(RunnerStatus.FAILED, error=f"rank failed: {exc}")
            return EXIT_PEER_LOST if is_ring_error(str(exc)) else 1
        self.publish(RunnerStatus.SHUTTING_DOWN, RunnerStatus.SHUTDOWN)
        log.info("rank stopped cleanly")
        return 0

    def _stepping(self, active: int, awaiting_first_token: int) -> None:
        self.progress.record(
            active=active, awaiting_first_token=awaiting_first_token, progressed=True
        )

    def _stepped(self) -> None:
        # Waiting for the next plan: idle for the watchdog, whatever jobs it holds.
        self.progress.record(active=0, awaiting_first_token=0, progressed=True)

    def _rest(self) -> None:
        """Rank 0 has no job: show the memory the batch took, then wait off the ring for rank
        0's word that its next plan comes. Both in Redis, which rank 0 never waits for here (a
        write between two plans held rank 0 in its next collective while Redis was paused).
        Redis unreachable: wait for it (rank 0 can take no job meanwhile)."""
        rank = self.spec.rank
        assert rank is not None
        shown = woken = False
        while not woken:
            try:
                if not shown:
                    self._publish_memory()
                    shown = True
                woken = self.store.instances.wait_for_wake(
                    rank.instance_id, rank.generation, rank.rank, WAKE_WAIT_S
                )
            except redis.RedisError as exc:
                if not redis_waits(exc):
                    raise
                log.warning("redis unreachable; idle rank waits", extra={"error": str(exc)})
                time.sleep(ADDRESS_POLL_S)

    def _publish_memory(self) -> None:
        assert self.engine is not None
        memory, peak = self.engine.memory
        changes = {"memory_bytes": memory, "peak_memory_bytes": peak, "updated_at": utcnow()}
        self.state = self.state.model_copy(update=changes)
        self.store.runners.publish(self.state, status_changed=False)


def fail_instance(store: Store, spec: RunnerSpec, cause: str) -> None:
    """Record that this rank's instance failed, naming this rank (if it had not failed yet)."""
    assert spec.rank is not None
    error = rank_failure(spec.rank.rank, spec.host, cause)
    store.instances.transition(
        spec.rank.instance_id, FAILED, error=error, generation=spec.rank.generation
    )
