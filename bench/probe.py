"""A liveness probe in a process of its own, as a load balancer's or an orchestrator's is:
`python -m bench.probe URL SECONDS` GETs URL on a new connection every PROBE_EVERY_S for
SECONDS and prints each answer's time in seconds, as a JSON list (a failed or timed-out probe
counts as TIMEOUT_S). Run as a thread of the bench, a probe measured the bench's own event
loop (thousands of sockets on the same GIL) more than the server: p99 two to three times
the same probe's from a process of its own, at the same moment."""

from __future__ import annotations

import json
import sys
import time

import requests

PROBE_EVERY_S = 0.05
TIMEOUT_S = 10.0


def probe(url: str, seconds: float) -> list[float]:
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            with requests.Session() as session:
                session.get(url, timeout=TIMEOUT_S).raise_for_status()
            times.append(time.monotonic() - started)
        except requests.RequestException:
            times.append(TIMEOUT_S)
        time.sleep(PROBE_EVERY_S)
    return times


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], float(sys.argv[2]))))
