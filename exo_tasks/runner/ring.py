"""The ring of an instance's ranks over `mx.distributed` (its `ring` backend, plain TCP): each
rank listens on a port of its own, publishes it in Redis, and joins the ring once every rank of
the same start (generation) has published. mlx reads the ring from two environment variables,
as `mlx.launch` sets them: MLX_RANK and MLX_HOSTFILE (a JSON list, in rank order, of each rank's
"address:port" list)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any


def free_port(address: str) -> int:
    """A port free on `address` now. mlx binds it itself (with SO_REUSEADDR) when the ring
    forms, a few seconds later: another process may take it meanwhile, and the ring then fails
    to form, which fails this start (the next one picks another port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def join(rank: int, endpoints: list[tuple[str, int]]) -> Any:
    """Join the ring of `endpoints` (every rank's address and port, in rank order) as `rank`;
    the group. Blocks until every rank has joined: mlx accepts without a time limit (the
    supervisor's start timeout bounds it) and connects with 5 tries over 15 s."""
    import mlx.core as mx

    hosts = [[f"{address}:{port}"] for address, port in endpoints]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hostfile:
        json.dump(hosts, hostfile)
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = hostfile.name
    try:
        return mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(hostfile.name)
