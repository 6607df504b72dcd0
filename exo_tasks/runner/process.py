"""A runner's process: what the supervisor hands it (the spec), what the two share (the progress
array), how it builds its engine and reads its inbox, and its exit codes. The batching loop is
`exo_tasks.runner.loop`; the spawned process's entry point, `exo_tasks.runner.main`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel

from config.settings import Settings
from exo_tasks import lifecycle
from exo_tasks.fleet_types import RunnerState
from exo_tasks.instances import InstanceRecord
from exo_tasks.naming import (
    instance_runner_id,
    is_local_path,
    model_path,
    model_slug,
    runner_id_for,
)
from exo_tasks.types import utcnow

if TYPE_CHECKING:  # the engine imports MLX, which only the runner process needs
    from tokenizers import Tokenizer

    from exo_tasks.runner.engine import BatchEngine
    from exo_tasks.runner.lane import TokenDelta
    from exo_tasks.runner.prefiller import Prefiller
    from exo_tasks.types import ChatMessage, SamplingParams
    from exo_tasks.wire import Tool

# The signal at which a runner writes every thread's Python stack to its log (faulthandler, so
# also from inside a call into C, a collective say): the supervisor sends it to a hung runner
# before stopping it, so the log shows where it hung.
STACKS_SIGNAL = signal.SIGUSR2
# Exit code of a runner that cannot work as configured: the supervisor does not restart it.
EXIT_CONFIG = 78  # EX_CONFIG
# Exit code of a runner that unloaded its idle model: started again on demand, not restarted.
EXIT_UNLOADED = 3
# Exit code of a runner that exits on SIGTERM without stopping in order (128 + SIGTERM).
EXIT_TERMINATED = 143


class ConfigError(Exception):
    """The runner's configuration is wrong: restarting it would fail the same way."""


class RankSpec(BaseModel):
    """A runner that is one rank of an instance: which start (generation) of which instance,
    and where it listens for its ring peers."""

    instance_id: str
    generation: int
    rank: int
    world: int
    parallel: Literal["tensor", "pipeline"]
    address: str  # EXO_RING_ADDRESS


def rank_failure(rank: int, host: str, cause: str) -> str:
    """Why an instance failed, as its `error` says it: the rank, its host and the cause."""
    return f"rank {rank} on host {host}: {cause}"


class RunnerSpec(BaseModel):
    """Everything a runner process needs, handed over by the supervisor at spawn."""

    runner_id: str
    host: str
    model: str
    model_path: str
    redis_url: str
    job_ttl_s: int
    max_prompt_tokens: int
    max_job_bytes: int = 8 << 20  # EXO_MAX_JOB_BYTES
    restarts: int = 0
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 256
    prefill_process_min_tokens: int = 512  # EXO_PREFILL_PROCESS_MIN_TOKENS; 0: off
    prompt_cache_bytes: int = 1 << 30  # EXO_PROMPT_CACHE_BYTES
    prefix_routing_ttl_s: float = 900.0  # EXO_PREFIX_ROUTING_TTL_S; 0: no hints written
    lanes: int | None = None  # None: the engine's default for the device
    idle_unload_s: float | None = None  # None: stay loaded while idle
    log_level: str = "INFO"
    rank: RankSpec | None = None  # None: the whole model

    @classmethod
    def for_model(cls, model_path: str, settings: Settings) -> RunnerSpec:
        """The spec of this host's runner for the model at `model_path`."""
        slug = model_slug(model_path)
        return cls(
            runner_id=runner_id_for(slug, settings.hostname),
            host=settings.hostname,
            model=slug,
            model_path=model_path,
            redis_url=settings.effective_redis_url,
            job_ttl_s=settings.job_ttl_s,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_job_bytes=settings.max_job_bytes,
            completion_batch_size=settings.completion_batch_size,
            prefill_batch_size=settings.prefill_batch_size,
            prefill_step_size=settings.prefill_step_size,
            prefill_process_min_tokens=settings.prefill_process_min_tokens,
            prompt_cache_bytes=settings.prompt_cache_bytes,
            prefix_routing_ttl_s=settings.prefix_routing_ttl_s,
            lanes=settings.runner_lanes,
            idle_unload_s=settings.runner_idle_unload_s,
            log_level=settings.log_level,
        )

    @classmethod
    def for_rank(
        cls, instance: InstanceRecord, rank: int, model_path: str, settings: Settings
    ) -> RunnerSpec:
        """The spec of this host's rank of `instance`: one lane (the ranks run their batch
        operations in one order), never unloaded while idle (rank 0 alone could not)."""
        whole = cls.for_model(model_path, settings)
        spec = RankSpec(
            instance_id=instance.id,
            generation=instance.generation,
            rank=rank,
            world=len(instance.hosts),
            parallel=instance.parallel,
            address=settings.ring_address,
        )
        update = {
            "runner_id": instance_runner_id(instance.id, rank),
            "model": instance.model,
            "lanes": 1,
            "idle_unload_s": None,
            "rank": spec,
        }
        return whole.model_copy(update=update)

    def first_state(self) -> RunnerState:
        """The state a runner process starts with, in this process."""
        return lifecycle.spawned_runner(
            self.runner_id,
            self.host,
            self.model,
            pid=os.getpid(),
            started_at=utcnow(),
            restarts=self.restarts,
        )


class RunnerProgress:
    """Shared memory with the supervisor, so it can tell a hung runner from a busy one:
    [time of the last progress (monotonic), active jobs, jobs still waiting for a first token,
    since when the runner waits for Redis (0: it does not)]."""

    def __init__(self, array: Any) -> None:
        self.array = array

    @classmethod
    def create(cls, context: Any) -> RunnerProgress:
        # No lock: a runner SIGKILLed while holding it would leave the supervisor blocked.
        return cls(context.Array("d", 4, lock=False))

    def record(self, *, active: int, awaiting_first_token: int, progressed: bool) -> None:
        if progressed:
            self.array[0] = time.monotonic()
        self.array[1], self.array[2] = active, awaiting_first_token

    @contextlib.contextmanager
    def waiting_for_redis(self) -> Iterator[None]:
        """The time spent inside is not silence: a slow or paused Redis is not a hung runner
        (each call's own timeout bounds the wait; a Redis that refuses is waited out as
        progress by the loop). Written in this order, the supervisor never reads a wait's end
        without its time taken off the silence."""
        began = time.monotonic()
        self.array[3] = began
        try:
            yield
        finally:
            self.array[0] += time.monotonic() - began
            self.array[3] = 0.0

    def stall(self, prefill_timeout_s: float, decode_timeout_s: float) -> str | None:
        """Why the runner counts as hung, or None. Idle is never a stall."""
        waiting_since = self.array[3]  # read before the last progress (see waiting_for_redis)
        last, active, awaiting = self.array[0], self.array[1], self.array[2]
        if active == 0:
            return None
        now = time.monotonic()
        if waiting_since:
            waited_s = now - waiting_since
            if waited_s > prefill_timeout_s:  # longer than any call's timeouts: not Redis
                return f"stalled waiting for Redis ({waited_s:.1f}s)"
            now = waiting_since  # the silence ends where the wait began
        silent_s = now - last
        if awaiting and silent_s > prefill_timeout_s:
            return f"stalled in prefill (no first token for {silent_s:.1f}s)"
        if not awaiting and silent_s > decode_timeout_s:
            return f"stalled in decode (no token for {silent_s:.1f}s)"
        return None


class Engine(Protocol):
    """What the runner's loop needs of a batching engine (`exo_tasks.runner.engine.BatchEngine`)."""

    @property
    def lanes(self) -> int: ...
    @property
    def largest_batch(self) -> int: ...
    @property
    def prefill_chunks(self) -> int: ...
    @property
    def tool_calling(self) -> bool: ...
    @property
    def prompt_cache_bytes(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def memory(self) -> tuple[int, int]: ...
    @property
    def prompt_tokenizer(self) -> Tokenizer | None: ...
    def encode(
        self,
        prompt: str | None,
        messages: list[ChatMessage] | None,
        tools: list[Tool] | None = None,
    ) -> list[int]: ...
    def add(self, job_id: str, prompt_tokens: list[int], params: SamplingParams) -> None: ...
    def remove(self, job_id: str) -> None: ...
    def step(self) -> list[TokenDelta]: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...


def check_model_path(model: str) -> None:
    """A model given as a local path must exist; anything else is a hub id for mlx_lm."""
    if is_local_path(model) and not model_path(model).exists():
        raise ConfigError(f"model path '{model}' does not exist")


def load_engine(spec: RunnerSpec) -> Engine:
    """Load the spec's model into a batching engine (not yet warmed up); on the CPU, with its
    prefill process for long prompts (EXO_PREFILL_PROCESS_MIN_TOKENS), started by the first."""
    import mlx.core as mx
    import mlx_lm

    from exo_tasks.runner.engine import weights_bytes
    from exo_tasks.runner.prefiller import Prefiller

    check_model_path(spec.model_path)
    model, tokenizer = mlx_lm.load(spec.model_path)[:2]
    minimum, step = spec.prefill_process_min_tokens, spec.prefill_step_size
    on_cpu = mx.default_device() == mx.cpu
    prefiller = (
        Prefiller(spec.model_path, minimum, step, weights_bytes(model))
        if minimum and on_cpu
        else None
    )
    return build_engine(spec, model, tokenizer, lanes=spec.lanes, prefill_process=prefiller)


def build_engine(
    spec: RunnerSpec,
    model: Any,
    tokenizer: Any,
    *,
    lanes: int | None,
    prefill_process: Prefiller | None = None,
) -> BatchEngine:
    """A batching engine over a loaded model (or a rank's shard), sized by the spec."""
    from exo_tasks.runner.engine import BatchEngine

    return BatchEngine(
        model,
        tokenizer,
        completion_batch_size=spec.completion_batch_size,
        prefill_batch_size=spec.prefill_batch_size,
        prefill_step_size=spec.prefill_step_size,
        lanes=lanes,
        prompt_cache_bytes=spec.prompt_cache_bytes,
        prefill_process=prefill_process,
    )
