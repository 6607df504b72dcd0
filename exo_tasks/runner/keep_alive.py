"""When an idle runner unloads its model: EXO_RUNNER_IDLE_UNLOAD_S after it last had work, or
as the last job's own `keep_alive` says (Ollama's meaning, in seconds: 0 unloads at once,
negative never). The latest job's word counts, as in Ollama. Pure: the runner gives the time."""

from __future__ import annotations


class KeepAlive:
    def __init__(self, idle_unload_s: float | None, *, jobs_decide: bool = True) -> None:
        """`jobs_decide`: whether a job's `keep_alive` counts (never for a rank of an instance:
        one rank alone cannot leave its ring)."""
        self.idle_unload_s = idle_unload_s
        self.jobs_decide = jobs_decide
        self.unload_at: float | None = None  # monotonic; None: stay loaded

    def idle_from(self, now: float, keep_alive_s: float | None = None) -> None:
        """The runner has no work from `now` (it became ready, or a job ended that asked to
        keep the model `keep_alive_s`)."""
        keep = self.idle_unload_s if keep_alive_s is None or not self.jobs_decide else keep_alive_s
        self.unload_at = None if keep is None or keep < 0 else now + keep

    def due(self, now: float) -> bool:
        return self.unload_at is not None and now >= self.unload_at
