"""The embedded Redis's password: made at first start in a private file, required by Redis,
used by every process of the stack, and never on a command line or in a log. Flower's
`/metrics` is behind its basic auth."""

from __future__ import annotations

import stat
from pathlib import Path

import psutil
import pytest
import redis
import requests

from config.settings import Settings
from exo_tasks.redis_auth import redis_auth_conf, redis_password
from exo_tasks.redis_server import wait_for_redis
from exo_tasks.store import Store
from tests.support.processes import EXO_TASKS, Processes, exo_env, free_port, wait_http, wait_until
from tests.support.workers import Worker, wait_runner_ready

FLOWER_AUTH = ("admin", "s3cret-flower")


def test_the_password_is_made_once_and_readable_by_its_user_alone(tmp_path: Path) -> None:
    password = redis_password(tmp_path / "redis")
    assert redis_password(tmp_path / "redis") == password and len(password) >= 32
    conf = redis_auth_conf(tmp_path / "redis")
    assert conf.read_text() == f"requirepass {password}\nmasterauth {password}\n"
    for path in (tmp_path / "redis" / "password", conf):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "redis").iterdir()] == sorted(["auth.conf", "password"])


def test_the_embedded_stack_runs_behind_its_password_and_never_shows_it(
    processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    redis_port, api_port, flower_port = free_port(), free_port(), free_port()
    data_dir = tmp_path / "data"
    env = exo_env(
        data_dir=data_dir,
        redis_port=redis_port,
        api_port=api_port,
        flower_port=flower_port,
        flower_basic_auth=":".join(FLOWER_AUTH),
        hostname="sec-host",
        models=tiny_model,
        worker_concurrency=4,
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("redis", "worker", "api", "flower")}
    processes.start([EXO_TASKS, "redis"], env, logs["redis"])
    url = Settings(_env_file=None, data_dir=data_dir, redis_port=redis_port).effective_redis_url
    wait_for_redis(url)
    password = redis_password(data_dir / "redis")

    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=redis_port, socket_timeout=5).ping()  # a local client without it

    worker = processes.start([EXO_TASKS, "worker"], env, logs["worker"])
    api = processes.start([EXO_TASKS, "api"], env, logs["api"])
    flower = processes.start([EXO_TASKS, "flower"], env, logs["flower"])
    wait_runner_ready(Store.from_url(url), Worker("sec-host", env, logs["worker"], worker))
    base = f"http://127.0.0.1:{api_port}"
    wait_http(f"{base}/healthz", api, logs["api"])
    created = requests.post(f"{base}/v1/jobs", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
    assert created.status_code == 202, created.text
    job_url = f"{base}/v1/jobs/{created.json()['id']}"
    job = wait_until(
        lambda: (j := requests.get(job_url, timeout=10).json())["status"] == "succeeded" and j,
        30,
        "the job",
    )
    assert job["output"]["text"] is not None

    flower_url = f"http://127.0.0.1:{flower_port}"
    wait_http(f"{flower_url}/healthcheck", flower, logs["flower"])
    assert requests.get(f"{flower_url}/metrics", timeout=10).status_code == 401
    wrong = requests.get(f"{flower_url}/metrics", auth=("admin", "wrong"), timeout=10)
    assert wrong.status_code == 401
    metrics = requests.get(f"{flower_url}/metrics", auth=FLOWER_AUTH, timeout=10)
    assert metrics.status_code == 200 and "flower_" in metrics.text

    processes.remember_descendants()
    pids = {p.pid for p in processes.started} | processes.extra_pids
    assert len(pids) >= 6  # redis, worker, its runner and pool children, api workers, flower
    for pid in pids:
        try:
            command = " ".join(psutil.Process(pid).cmdline())
            environ = psutil.Process(pid).environ()
        except psutil.NoSuchProcess:
            continue
        assert password not in command, command
        # Flower's password reaches it by environment (only its user reads /proc/<pid>/environ).
        assert FLOWER_AUTH[1] not in command, command
        assert password not in " ".join(environ.values())
    for name, path in logs.items():
        assert password not in path.read_text(errors="replace"), name
    assert_private(data_dir, prompt="hi")


def assert_private(data_dir: Path, prompt: str) -> None:
    """Every file under EXO_DATA_DIR that holds user data or secrets is 0600 in directories
    that are 0700 (the AOF was 0644 in a 0755 directory: every prompt and output readable by
    every local user). Model weights are neither."""
    walked = {
        path.relative_to(data_dir): stat.S_IMODE(path.stat().st_mode)
        for path in data_dir.rglob("*")
        if path.relative_to(data_dir).parts[0] != "models"
    }
    aof = [p for p in walked if "appendonly" in p.name and (data_dir / p).is_file()]
    assert aof and any(prompt.encode() in (data_dir / p).read_bytes() for p in aof), walked
    assert {"redis/password", "redis/auth.conf"} <= {str(p) for p in walked}
    for path, mode in walked.items():
        wanted = 0o700 if (data_dir / path).is_dir() else 0o600
        assert mode == wanted, f"{path} is {mode:o}, not {wanted:o}"
