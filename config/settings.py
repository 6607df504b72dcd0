"""All configuration, from the environment (prefix EXO_) and `.env`."""

from __future__ import annotations

import socket
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exo_tasks import limits

# Names live in exo_tasks.naming; this stays importable from here for older imports.
from exo_tasks.naming import INSTANCES_FORMAT
from exo_tasks.naming import model_slug as model_slug
from exo_tasks.redis_auth import PASSWORD_FILE, redis_password
from exo_tasks.sentinel_addresses import parse_addresses

if TYPE_CHECKING:
    from exo_tasks.instances import InstanceRequest
    from exo_tasks.redis_sentinel import Sentinels

# The model a host serves when EXO_MODELS is empty, made at start: the `chat` preset.
DEFAULT_PRESET = "chat"
DEFAULT_MODEL_DIRNAME = f"models/{DEFAULT_PRESET}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXO_", env_file=".env", extra="ignore")

    # Where things run.
    redis_url: str | None = Field(None, description="Unset: the stack runs its own redis-server.")
    redis_port: int = 6379
    redis_sentinels: str = Field(
        "",
        description="host:port,... of Redis Sentinels: set, every process finds the Redis "
        "master through them and follows a failover (instead of EXO_REDIS_URL). The master's "
        "password is the stack's, EXO_DATA_DIR/redis/password, on every host.",
    )
    redis_master_name: str = Field("exo", description="The master's name at the Sentinels.")
    redis_sentinel_password_file: Path | None = Field(
        None, description="A file holding the Sentinels' own password; unset: none."
    )
    redis_ha: bool = Field(
        False,
        description="The stack's own Redis as a master, a replica (EXO_REDIS_PORT + 1) and "
        "three Sentinels (EXO_REDIS_SENTINEL_PORT and the next two) on loopback, which every "
        "process of the stack uses (`exo-tasks up --ha`).",
    )
    redis_sentinel_port: int = 26379
    redis_replica_wait_ms: int = Field(
        500,
        ge=0,
        description="Behind Sentinels, how long a new job's 202 (a new file's or batch's answer, "
        "a round of a batch's lines) waits at most for a replica to hold it (Redis WAIT); past "
        "that, or with no replica connected, it is accepted all the same and the answer says "
        "`Exo-Replicated: false`. 0: never wait.",
    )
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_workers: int = 2
    api_header_timeout_s: float = Field(
        10.0, gt=0, description="How long a client may take to send its request (then 408)."
    )
    api_io_timeout_s: float = Field(
        30.0, gt=0, description="A stalled read or write on a request being served (then closed)."
    )
    api_body_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a client may take to send a request's whole body, from the end "
        "of its head (then 408): a body trickled a byte a second never stalls a read.",
    )
    max_streams: int = Field(
        2000,
        ge=1,
        description="Open event streams (job streams, streamed OpenAI completions) per API "
        "process; past it a new one gets 503 with Retry-After at once.",
    )
    stream_buffer_events: int = Field(
        1024,
        ge=1,
        description="Events a stream buffers for a client that reads slower than its job "
        "generates; past it the stream is closed (an OpenAI completion's job cancelled).",
    )
    api_redis_connections: int = Field(
        32, ge=2, description="Redis connections per API process (shared by every request)."
    )
    flower_port: int = 5555
    flower_basic_auth: SecretStr | None = Field(None, description="user:password for Flower.")
    api_token: SecretStr | None = Field(None, description="Set: every route but health needs it.")
    api_url: str | None = Field(None, description="The API the CLI talks to; unset: this host's.")
    data_dir: Path = Path("var")
    hostname: str = Field(default_factory=socket.gethostname)
    models: str = Field("", description="Comma-separated model paths or hub ids; '' = chat.")
    instances: str = Field(
        "",
        description="Model instances across hosts, placed when a worker starts (the same list "
        f"on every host is placed once): {INSTANCES_FORMAT}. "
        "E.g. '/models/big@mac-a,mac-b;mlx-community/Llama-3.3-70B@a,b,c,d:tensor'.",
    )

    # The worker.
    worker_concurrency: int = 34  # pool children: up to a full batch of 32, plus control tasks
    worker_idle_concurrency: int = Field(
        2,
        ge=1,
        description="Pool children kept while the host is idle: the pool grows as jobs arrive, "
        "up to EXO_WORKER_CONCURRENCY, and shrinks back 30-60 s after the last task came "
        "(Celery's autoscaler). Each child holds ~6 MiB of its own, ~12 once it has run a task.",
    )
    worker_soft_shutdown_s: float = 30.0
    stack_drain_s: float = Field(
        1.0,
        ge=0,
        description="The drain window of a worker in a local stack (`worker --in-stack`, the "
        "Procfile): the whole stack stops within honcho's 5 s.",
    )
    job_soft_time_limit_s: float = 600.0
    job_hard_grace_s: float = 30.0
    runner_shutdown_grace_s: float = 30.0
    runner_start_timeout_s: float = 300.0
    ring_address: str = Field(
        "127.0.0.1",
        description="The address this host's instance ranks listen on for their ring peers "
        "(mx.distributed's ring backend, TCP; a port chosen at each start): one the other "
        "hosts of the instance can reach.",
    )
    runner_max_restarts: int = 5
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 5.0
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = Field(
        256,
        ge=1,
        description="Prompt tokens a runner prefills per step at most; each step is progress "
        "for the prefill stall limit, so a long prompt is work, not a hang. On the CPU, while "
        "jobs decode, a step prefills only for about as long as a decode step (fewer tokens).",
    )
    prefill_process_min_tokens: int = Field(
        512,
        ge=0,
        description="On the CPU: a prompt with at least this many tokens left to compute is "
        "prefilled by a process of its own beside the runner, so jobs decoding meanwhile are "
        "not held up by it. The process, a second copy of the model in memory, starts with the "
        "first such prompt, and only where the host's available memory holds the model twice "
        "over; 0: off, the runner's steps prefill every prompt between decode steps.",
    )
    prompt_cache_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Bytes of KV state each runner keeps for reuse by prompts sharing a prefix "
        "(recent prompts and conversations, least recently used dropped first); 0: off.",
    )
    direct_hand_over: bool = Field(
        True,
        description="A job whose runner has room is handed to it as it is submitted, and its "
        "Celery task, sent to that runner's host, follows it once delivered: the job does not "
        "wait for Celery's delivery and a pool child before its first step. Off: every job is "
        "handed over by its task.",
    )
    direct_task_delay_ms: int = Field(
        100,
        ge=0,
        description="A short job (at most 16 tokens) handed over directly has its Celery task "
        "sent this long after, unless it has succeeded by then: that task is then stored SUCCESS "
        "and its events sent, with no message, so that a short job does not pay a Celery round "
        "trip on the same cores. Its runner holds its time limits from the start; any other "
        "job's task is sent at once. 0: sent at once.",
    )
    prefix_routing_ttl_s: float = Field(
        900.0,
        ge=0,
        description="Where two hosts or more serve a model, a job whose prompt begins with what "
        "one of them ran within this many seconds goes to that host's queue (its prompt cache "
        "holds the prefix) unless that host is saturated; 0: off, every job to the model's queue.",
    )
    runner_idle_unload_s: float | None = Field(
        None,
        ge=0,
        description="A runner idle this long unloads its model (its process exits, freeing the "
        "memory); the next job for the model loads it again. Unset: never. A job's keep_alive "
        "overrides it for the idle time after that job.",
    )
    runner_lanes: int | None = Field(
        None,
        ge=1,
        description="Batches a runner runs side by side; unset: 1 on a GPU, on the CPU one per "
        "core (at most 8), since MLX keeps one batch on one core.",
    )

    # Jobs and the broker.
    max_tokens: int = 4096
    max_queued_jobs: int = 1000
    max_queued_jobs_per_client: int = Field(
        250,
        ge=1,
        description="Jobs one client (its `user`, else its API token, else its address) may "
        "have waiting in the queues at once; past it 429 with Retry-After, while other clients' "
        "jobs are still taken. A quarter of EXO_MAX_QUEUED_JOBS: one client does not fill a queue.",
    )
    max_prompt_chars: int = 100_000
    max_prompt_tokens: int = Field(
        8192, ge=1, description="The cap on a prompt's tokens after the chat template."
    )
    max_stop_chars: int = Field(256, ge=1, description="The cap on each stop string's length.")
    max_job_bytes: int = Field(
        8 << 20,
        ge=1 << 16,
        description="What one job may store in Redis: its prompt, and its output twice (its "
        "event stream and its record), log probabilities included. A job that passes it fails "
        "with its text so far, naming this setting.",
    )
    redis_reserve_mb: int = Field(
        256,
        ge=0,
        description="Redis memory kept for the fleet's own writes (heartbeats, runner states, "
        "the outputs of running jobs, endings, cancels): past EXO_REDIS_MAXMEMORY_MB less this, "
        "new jobs, files and batches are refused with 503 (storage_full).",
    )
    max_body_bytes: int = 1 << 20
    broker_visibility_timeout_s: float = 3600.0
    broker_restore_interval_s: float = 10.0
    job_ttl_s: int = Field(
        24 * 3600,
        ge=60,
        description="How long a job's record, event streams and Celery result are kept.",
    )
    redis_maxmemory_mb: int = Field(
        1024,
        ge=1,
        description="The embedded Redis's memory cap; full, it refuses writes (never evicts).",
    )
    control_expires_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long a shutdown_runner or load_runner task stays valid in its queue; "
        "a worker drops (and logs) one that waited longer.",
    )
    batch_max_file_bytes: int = Field(
        100 << 20, ge=1, description="The largest file POST /v1/files takes (then 413)."
    )
    batch_max_lines: int = Field(
        50_000, ge=1, description="The most requests one batch's input file may hold."
    )
    batch_inflight_per_host: int = Field(
        32,
        ge=1,
        description="Batch requests that are jobs at once on each live host, all batches "
        "together; never more than its pool children less 2, left for interactive jobs.",
    )
    batch_max_queued: int = Field(
        16,
        ge=1,
        description="Batch jobs waiting in a queue at once: the feeder sends more as the fleet "
        "takes them, never a backlog ahead of interactive jobs (nor near EXO_MAX_QUEUED_JOBS).",
    )
    log_level: str = "INFO"

    @property
    def effective_redis_url(self) -> str:
        """The master through the Sentinels, or EXO_REDIS_URL, or the embedded Redis with its
        password (made at first use)."""
        if self.sentinels is not None:
            return self.sentinels.url()
        if self.redis_url:
            return self.redis_url
        password = redis_password(self.data_dir / "redis")
        return f"redis://:{password}@127.0.0.1:{self.redis_port}/0"

    @property
    def sentinels(self) -> Sentinels | None:
        """EXO_REDIS_SENTINELS, or the HA stack's own, with the passwords; None: no Sentinels."""
        addresses = parse_addresses(self.redis_sentinels)
        password_file = self.redis_sentinel_password_file
        if self.redis_ha:  # the stack's own, behind the stack's password
            addresses = [("127.0.0.1", port) for port in self.ha_sentinel_ports]
            password_file = self.data_dir / "redis" / PASSWORD_FILE
        if not addresses:
            return None
        from exo_tasks.redis_sentinel import Sentinels  # redis-py: see _instances_well_formed

        password = redis_password(self.data_dir / "redis")  # made first: the HA stack's too
        sentinel_password = password_file.read_text().strip() if password_file else None
        return Sentinels(
            addresses=addresses,
            master_name=self.redis_master_name,
            password=SecretStr(password),
            sentinel_password=SecretStr(sentinel_password) if sentinel_password else None,
        )

    @property
    def ha_sentinel_ports(self) -> list[int]:
        return [self.redis_sentinel_port + i for i in range(3)]

    @property
    def effective_api_url(self) -> str:
        return (self.api_url or f"http://{self.api_host}:{self.api_port}").rstrip("/")

    @property
    def default_model_dir(self) -> Path:
        return self.data_dir / DEFAULT_MODEL_DIRNAME

    @cached_property
    def served_models(self) -> list[str]:
        """The models this host serves, in order; the first is the default for jobs."""
        listed = [m.strip() for m in self.models.split(",") if m.strip()]
        return listed or [str(self.default_model_dir.resolve())]

    @cached_property
    def configured_instances(self) -> list[InstanceRequest]:
        """EXO_INSTANCES, parsed (checked when the settings are read)."""
        from exo_tasks.instances import parse_instances  # see _instances_well_formed

        return parse_instances(self.instances)

    @model_validator(mode="after")
    def _limits_below_redelivery(self) -> Settings:
        limits.check_settings(self)
        return self

    @model_validator(mode="after")
    def _one_redis(self) -> Settings:
        parse_addresses(self.redis_sentinels)  # ValueError naming the entry
        chosen = [self.redis_url, self.redis_sentinels, self.redis_ha]
        if sum(map(bool, chosen)) > 1:
            raise ValueError(
                "set one of EXO_REDIS_URL, EXO_REDIS_SENTINELS and EXO_REDIS_HA (which runs "
                "its own Sentinels), not two"
            )
        return self

    @model_validator(mode="after")
    def _instances_well_formed(self) -> Settings:
        # Imported only when there are some: the launcher and `exo-tasks redis` read these
        # settings and need neither the wire models nor redis-py's Sentinel (~25 MiB each).
        if self.instances.strip():
            from exo_tasks.instances import parse_instances

            parse_instances(self.instances)  # ValueError naming the entry
        return self
