"""The fleet as the API sees it: the hosts whose heartbeat is live, their runners, and the
instances placed across them. It decides which queue a job may go to, and refuses jobs that no
live runner could ever take.

A model that some live host serves whole, with a runner up or starting, goes to its runners;
any other model goes to an instance of it (exo_tasks.instances), the Ready one first: a whole
runner runs a job with no exchange between hosts at every step, and an instance exists for the
model that fits no single host."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from exo_tasks.errors import InvalidRequest, NotFound, Unavailable
from exo_tasks.fleet_types import HostState, RunnerState
from exo_tasks.instances import InstanceRecord, InstanceStatus
from exo_tasks.naming import host_queue, instance_of_runner, model_queue, runner_id_for
from exo_tasks.shared_read import SharedRead
from exo_tasks.store import Store
from exo_tasks.store.hosts import fleet_of
from exo_tasks.store.metrics import memory_of


def is_down(state: RunnerState | None) -> bool:
    """Stopped or failed for good; a runner not yet published is still starting."""
    return state is not None and state.is_down


# An instance in these takes jobs now, or once its ranks are up (they wait in its queue).
SERVING = (InstanceStatus.PENDING, InstanceStatus.STARTING, InstanceStatus.READY)


@dataclass
class Fleet:
    hosts: dict[str, HostState]
    runners: dict[str, RunnerState]
    instances: dict[str, InstanceRecord] = field(default_factory=dict)

    @classmethod
    def load(cls, store: Store) -> Fleet:
        """The fleet; a host whose shutdown has begun is in it no more (the recovery loop still
        counts it live: it owns the jobs it drains)."""
        return cls.of(store.hosts.fleet(), store.instances.all())

    @classmethod
    def of(
        cls, read: tuple[list[HostState], list[RunnerState]], instances: list[InstanceRecord]
    ) -> Fleet:
        """The fleet from the hosts and runners read (HostRecords.fleet) and the instances."""
        hosts, runners = read
        return cls(
            hosts={h.name: h for h in hosts if not h.stopping},
            runners={r.id: r for r in runners},
            instances={i.id: i for i in instances},
        )

    @property
    def models(self) -> list[str]:
        """Every model some live host serves whole, in host order, then every model of an
        instance not shut down (a job for it goes there, or is refused saying why)."""
        whole = [m for host in self.hosts.values() for m in host.models]
        placed = [
            i.model for i in self.instances.values() if i.status is not InstanceStatus.SHUTDOWN
        ]
        return list(dict.fromkeys([*whole, *placed]))

    def live_runners(self) -> list[RunnerState]:
        """The runners of hosts whose heartbeat is live: a dead host's runners run nothing."""
        return [r for r in self.runners.values() if r.host in self.hosts]

    def whole_runners(self) -> list[RunnerState]:
        """The live runners that hold a model whole (not a rank of an instance)."""
        return [r for r in self.live_runners() if instance_of_runner(r.id) is None]

    def serves_whole(self, model: str) -> bool:
        """Whether a live host serves `model` whole with a runner that is up or starting (not
        stopped or failed for good)."""
        return any(
            self.serves(host, model) and not is_down(self.runners.get(runner_id_for(model, host)))
            for host in self.hosts
        )

    def dead_hosts(self, instance: InstanceRecord) -> list[str]:
        return [host for host in instance.hosts if host not in self.hosts]

    def serving_instances(self, model: str | None = None) -> list[InstanceRecord]:
        """The instances (of `model`) that take jobs now or once started, every host live:
        Ready ones first."""
        found = [
            i
            for i in self.instances.values()
            if i.status in SERVING and not self.dead_hosts(i) and model in (None, i.model)
        ]
        return sorted(found, key=lambda i: (i.status is not InstanceStatus.READY, i.id))

    def ready_instances(self) -> list[InstanceRecord]:
        return [i for i in self.serving_instances() if i.status is InstanceStatus.READY]

    def instance_for(self, model: str, host: str | None) -> InstanceRecord | None:
        """The instance a job for `model` (pinned to `host` or not) goes to: None where a live
        host serves the model whole (serves_whole) or no instance holds it; 404 when pinned to
        a host that is none of its instances'; 503 naming why when none of them can take it."""
        if self.serves_whole(model):
            return None
        placed = [
            i
            for i in self.instances.values()
            if i.model == model and i.status is not InstanceStatus.SHUTDOWN
        ]
        if host is not None:
            placed = [i for i in placed if host in i.hosts]
            if not placed:
                raise NotFound(
                    f"no instance of model '{model}' runs on host '{host}'", {"field": "host"}
                )
        ids = {i.id for i in placed}
        serving = [i for i in self.serving_instances(model) if i.id in ids]
        if serving:
            return serving[0]
        if not placed:
            return None
        raise Unavailable(
            f"model '{model}' is served only by instances that cannot take jobs now: "
            + "; ".join(f"{i.id} {self._why_not(i)}" for i in placed),
            {"model": model, "instances": [i.id for i in placed]},
        )

    def _why_not(self, instance: InstanceRecord) -> str:
        dead = self.dead_hosts(instance)
        if instance.status is InstanceStatus.FAILED:
            return f"is Failed ({instance.error}); it starts again once all its hosts are live"
        if dead:
            return f"is {instance.status}, waiting for host {', '.join(dead)} (no heartbeat)"
        return f"is {instance.status}"

    def host_runners(self, host: str) -> list[RunnerState]:
        return [r for r in self.runners.values() if r.host == host]

    def host_instances(self, host: str) -> list[InstanceRecord]:
        """The instances with a rank on `host`."""
        return [i for i in self.instances.values() if host in i.hosts]

    def host_view(self, host: str) -> dict[str, str]:
        """A host's runners and the instances it has a rank in, with their statuses, as lines
        of text (what Flower shows on the worker's page)."""
        runners = [f"{r.id}: {r.status}" for r in self.host_runners(host)]
        instances = [
            f"{i.id}: {i.status}, rank {i.hosts.index(host)} of {len(i.hosts)} "
            f"({i.model}, {i.parallel} parallel)"
            for i in self.host_instances(host)
        ]
        return {"exo_runners": "; ".join(runners), "exo_instances": "; ".join(instances)}

    def serves(self, host: str, model: str) -> bool:
        """Whether `host` is live and serves `model`."""
        state = self.hosts.get(host)
        return state is not None and model in state.models

    def queue_for(self, model: str, host: str | None) -> str:
        """The queue for a job on a served `model`, pinned to `host` or not: 404 when no live
        host of that name serves it, 503 when every runner that could take it is down."""
        if host is not None and not self.serves(host, model):
            live = ", ".join(self.hosts) or "none"
            raise NotFound(
                f"no live host '{host}' serves model '{model}' (live hosts: {live})",
                {"field": "host"},
            )
        hosts = [host] if host is not None else list(self.hosts)
        self._refuse_if_all_down(model, [h for h in hosts if self.serves(h, model)])
        return host_queue(host) if host is not None else model_queue(model)

    def refuse_tools_unless_supported(self, model: str) -> None:
        """A request with tools for a model whose runners all say its chat template takes none
        (a runner not loaded yet says nothing: its own check fails the job)."""
        known = [
            r.tool_calling
            for r in self.live_runners()
            if r.model == model and r.tool_calling is not None
        ]
        if known and not any(known):
            raise InvalidRequest(
                f"model '{model}' does not support tools: its chat template has no tool calling",
                {"field": "tools"},
            )

    def _refuse_if_all_down(self, model: str, hosts: list[str]) -> None:
        runner_ids = [runner_id_for(model, h) for h in hosts]
        if all(is_down(self.runners.get(r)) for r in runner_ids):
            states = "; ".join(f"{r}: {self.runners[r].status}" for r in runner_ids)
            raise Unavailable(
                f"every runner for model '{model}' is down ({states}); "
                "start one with POST /v1/runners",
                {"model": model, "runners": runner_ids},
            )


@dataclass(frozen=True)
class Door:
    """What the API reads before it takes a job: Redis's memory in use and its maxmemory
    (Store.metrics.memory), and the fleet."""

    memory: tuple[int, int]
    fleet: Fleet

    @classmethod
    def read(cls, store: Store) -> Door:
        """Both in one round trip (each was one or two of a job's, on its way in); a second
        one only to read instances, if there are any."""
        pipe = store.redis.pipeline(transaction=False)
        pipe.info("memory")
        store.hosts.read_fleet(pipe)
        store.instances.read_ids(pipe)
        info, fleet, instance_ids = pipe.execute()
        return cls(memory_of(info), Fleet.of(fleet_of(fleet), store.instances.of(instance_ids)))


class SharedReads:
    """The API's: requests that arrive together share each read (exo_tasks.shared_read), so
    a burst of clients costs a few round trips, not a few per client."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._fleet = SharedRead(partial(Fleet.load, store))
        self._depths: dict[str, SharedRead[int]] = {}  # by queue: one per model and host
        self._memory = SharedRead(store.metrics.memory)
        self._door = SharedRead(partial(Door.read, store))

    def fleet(self) -> Fleet:
        return self._fleet.get()

    def door(self) -> Door:
        """Redis's memory and the fleet, read together (a job's way in)."""
        return self._door.get()

    def memory(self) -> tuple[int, int]:
        """Redis's memory in use and its maxmemory (Store.memory)."""
        return self._memory.get()

    def queue_depth(self, queue: str) -> int:
        read = self._depths.get(queue)
        if read is None:
            read = self._depths.setdefault(
                queue, SharedRead(partial(self._store.jobs.queue_depth, queue))
            )
        return read.get()
