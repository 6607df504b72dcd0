"""A client that vanishes without a FIN, for real: run as `unshare -rn python -m
tests.support.vanish DIR` (a network namespace of its own, where this unprivileged process may
change routes). It starts redis-server and `exo-tasks api` (one worker, EXO_MAX_STREAMS=1)
there, opens one job stream from 127.0.0.2, then blackholes 127.0.0.2: the API's writes to it
are never acknowledged, as with a client whose host lost power. It writes to DIR/result.json
how the API answered a second stream while the first was open, and how long until a second
stream was accepted, that is until the API noticed the vanished one and closed it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from exo_tasks.store import Store
from exo_tasks.types import JobRecord, JobRequest
from tests.support.processes import (
    Processes,
    start_api,
    start_redis,
)

GIVE_UP_S = 120.0


def open_stream(port: int, job_id: str, source: str) -> socket.socket:
    """A job stream, its response head read; the socket stays open."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/jobs/{job_id}/stream HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def main(data_dir: Path) -> dict[str, object]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    processes = Processes()
    try:
        redis = start_redis(processes, data_dir / "redis")
        store = Store.from_url(redis.url)
        job = JobRecord(id="vanish", model="tiny", request=JobRequest(prompt="x"))
        store.jobs.create(job, "exo.model.tiny", 1000)  # queued for good: keepalives only
        settings = {"api_workers": 1, "max_streams": 1, "data_dir": data_dir}
        port = start_api(processes, data_dir / "api.log", redis_url=redis.url, **settings).port
        url = f"http://127.0.0.1:{port}/v1/jobs/{job.id}/stream"
        client = open_stream(port, job.id, "127.0.0.2")
        full = requests.get(url, timeout=5)
        subprocess.run(
            ["ip", "route", "add", "blackhole", "127.0.0.2/32", "table", "local"], check=True
        )
        vanished = time.monotonic()
        while time.monotonic() - vanished < GIVE_UP_S:
            with requests.get(url, stream=True, timeout=5) as response:
                if response.status_code == 200:
                    break
            time.sleep(0.25)
        noticed_s = time.monotonic() - vanished
        client.close()
        return {
            "full_status": full.status_code,
            "full_retry_after": full.headers.get("Retry-After"),
            "full_error": full.json()["error"],
            "noticed_s": noticed_s,
        }
    finally:
        processes.stop_all()


if __name__ == "__main__":
    data_dir = Path(sys.argv[1])
    (data_dir / "result.json").write_text(json.dumps(main(data_dir)))
