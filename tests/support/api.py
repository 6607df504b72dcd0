"""The API for tests and benchmarks: the real Flask app on a real port, as clients see it, and
the settings it is built from."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from werkzeug.serving import BaseWSGIServer, make_server

from config.settings import Settings
from exo_tasks.api import create_app
from tests.support.processes import wait_until


def api_settings(redis_url: str, models: list[Path], **overrides: Any) -> Settings:
    return Settings(
        redis_url=redis_url,
        models=",".join(str(m) for m in models),
        hostname="api-host",
        _env_file=None,
        **overrides,
    )


class Api:
    """The real Flask app on a real port (werkzeug's threaded server), as clients see it."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.server: BaseWSGIServer = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        # Its loop checks for shutdown every poll_interval: at the default 0.5 s, each close
        # (one per test for a function's API) waited up to that long.
        serve = {"poll_interval": 0.05}
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs=serve, daemon=True)
        self.thread.start()
        self.http = requests.Session()

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        return self.http.post(self.url + path, timeout=30, **kwargs)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.http.get(self.url + path, timeout=30, **kwargs)

    def submit(self, **body: Any) -> str:
        response = self.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job_id: str = response.json()["id"]
        return job_id

    def wait_job(self, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job: dict[str, Any] = self.get(f"/v1/jobs/{job_id}").json()
            return job if job["status"] not in ("queued", "running") else None

        result: dict[str, Any] = wait_until(done, timeout_s, f"job {job_id} to finish")
        return result

    def close(self) -> None:
        self.server.shutdown()
        self.http.close()


@contextlib.contextmanager
def serving(settings: Settings) -> Iterator[Api]:
    """The one way a test runs an API of its own: built from `settings`, closed at the end of
    the block whatever happened in it."""
    api = Api(settings)
    try:
        yield api
    finally:
        api.close()
