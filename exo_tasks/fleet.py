"""The fleet as the API sees it: the hosts whose heartbeat is live, and their runners. It decides
which queue a job may go to, and refuses jobs that no live runner could ever take."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from exo_tasks.errors import InvalidRequest, NotFound, Unavailable
from exo_tasks.fleet_types import HostState, RunnerState
from exo_tasks.naming import host_queue, model_queue, runner_id_for
from exo_tasks.shared_read import SharedRead
from exo_tasks.store import Store


def is_down(state: RunnerState | None) -> bool:
    """Stopped or failed for good; a runner not yet published is still starting."""
    return state is not None and state.is_down


@dataclass
class Fleet:
    hosts: dict[str, HostState]
    runners: dict[str, RunnerState]

    @classmethod
    def load(cls, store: Store) -> Fleet:
        hosts, runners = store.fleet()
        return cls(hosts={h.name: h for h in hosts}, runners={r.id: r for r in runners})

    @property
    def models(self) -> list[str]:
        """Every model some live host serves, in host order."""
        return list(dict.fromkeys(m for host in self.hosts.values() for m in host.models))

    def live_runners(self) -> list[RunnerState]:
        """The runners of hosts whose heartbeat is live: a dead host's runners run nothing."""
        return [r for r in self.runners.values() if r.host in self.hosts]

    def host_runners(self, host: str) -> list[RunnerState]:
        return [r for r in self.runners.values() if r.host == host]

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


class SharedReads:
    """The API's: requests that arrive together share each read (exo_tasks.shared_read), so
    a burst of clients costs a few round trips, not a few per client."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._fleet = SharedRead(partial(Fleet.load, store))
        self._depths: dict[str, SharedRead[int]] = {}  # by queue: one per model and host
        self._memory = SharedRead(store.memory)

    def fleet(self) -> Fleet:
        return self._fleet.get()

    def memory(self) -> tuple[int, int]:
        """Redis's memory in use and its maxmemory (Store.memory)."""
        return self._memory.get()

    def queue_depth(self, queue: str) -> int:
        read = self._depths.get(queue)
        if read is None:
            read = self._depths.setdefault(
                queue, SharedRead(partial(self._store.queue_depth, queue))
            )
        return read.get()
