"""A small client for the HTTP API, used by the CLI: JSON calls that carry the API token, the
API's errors raised as ExoError with its message, and a job's server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import requests

from exo_tasks.errors import ExoError

TIMEOUT_S = 30.0
POLL_S = 0.1
ACTIVE_STATUSES = ("queued", "running")


class ApiClient:
    def __init__(self, base_url: str, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, **params: Any
    ) -> Any:
        """The JSON the API answers; a 4xx/5xx becomes an ExoError with the API's message."""
        response = self._send(method, path, json=body, params=params, timeout=TIMEOUT_S)
        return response.json()

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """The raw response (a multipart upload, a file's bytes); 4xx/5xx as in `call`."""
        return self._send(method, path, timeout=TIMEOUT_S, **kwargs)

    def wait_ended(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The job once it has ended, or as it is after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while job["status"] in ACTIVE_STATUSES and time.monotonic() < deadline:
            time.sleep(POLL_S)
            job = self.call("GET", f"/v1/jobs/{job['id']}")
        return job

    def events(self, job_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """A job's events as (name, data), up to its last (`done` or `error`)."""
        response = self._send("GET", f"/v1/jobs/{job_id}/stream", stream=True, timeout=None)
        with response:
            name = ""
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    yield name, json.loads(line.removeprefix("data: "))
                    if name in ("done", "error"):
                        return

    def _send(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        try:
            response = self.session.request(method, self.base_url + path, **kwargs)
        except requests.ConnectionError as exc:
            # One line naming the URL: urllib3's text (a pool, its retries) says nothing more.
            raise ExoError(f"cannot reach the API at {self.base_url}") from exc
        except requests.Timeout as exc:
            raise ExoError(f"no answer from the API at {self.base_url} in time") from exc
        if response.status_code >= 400:
            raise ExoError(f"{response.status_code} {_error_message(response)}")
        return response


def _error_message(response: requests.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{error['type']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
