"""The fixtures every test module gets (tests/conftest.py loads this module as a plugin): a
real tiny model, a real redis-server, real workers and the real API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exo_tasks.store import Store
from tests.support.api import api_settings, serving
from tests.support.flower import Flower, running_flower
from tests.support.instances import Pair, running_pair
from tests.support.launcher import LocalStack, launcher_env
from tests.support.processes import Processes, RedisServer, start_redis
from tests.support.report import Report
from tests.support.stack import Stack, TwoHosts
from tests.support.workers import start_worker, wait_runner_ready


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exo_tasks.modelgen import create_model

    return create_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model: Path) -> tuple[Any, Any]:
    """The tiny model and its tokenizer wrapper, as mlx_lm loads them (read only: shared)."""
    import mlx_lm

    loaded = mlx_lm.load(str(tiny_model))
    return loaded[0], loaded[1]


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `chat` preset: byte-level BPE, ChatML, `<|im_end|>` as EOS."""
    from exo_tasks.modelgen import create_model

    return create_model("chat", tmp_path_factory.mktemp("models") / "chat")


@pytest.fixture(scope="session")
def gamma_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model no host serves whole, for instances (the tiny preset: 4 attention heads, 2
    key/value heads), named gamma."""
    from exo_tasks.modelgen import create_model

    return create_model("tiny", tmp_path_factory.mktemp("models") / "gamma")


@pytest.fixture
def placed(store: Store) -> Iterator[list[str]]:
    """The ids of the instances a test placed, removed at its end (their ranks, if any run,
    are stopped by their hosts)."""
    ids: list[str] = []
    yield ids
    for instance_id in ids:
        store.instances.remove(instance_id)


@pytest.fixture(scope="session")
def session_processes() -> Iterator[Processes]:
    processes = Processes()
    yield processes
    processes.stop_all()


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Processes a single test starts (and may kill); all stopped by PID at its teardown."""
    processes = Processes()
    yield processes
    processes.stop_all()


@pytest.fixture(scope="module")
def module_processes() -> Iterator[Processes]:
    """Processes a module shares between its tests (none of which changes them); all stopped
    by PID at the module's end."""
    processes = Processes()
    yield processes
    processes.stop_all()


@pytest.fixture(scope="session")
def redis_server(
    session_processes: Processes, tmp_path_factory: pytest.TempPathFactory
) -> RedisServer:
    return start_redis(session_processes, tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="session")
def store(redis_server: RedisServer) -> Store:
    return Store.from_url(redis_server.url)


@pytest.fixture(scope="session")
def stack(
    redis_server: RedisServer,
    store: Store,
    tiny_model: Path,
    session_processes: Processes,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """One host serving the tiny model, shared by the tests that do not break anything."""
    data_dir = tmp_path_factory.mktemp("stack")
    # Two lanes whatever the machine: every test on this stack runs them.
    worker = start_worker(
        session_processes, redis_server.url, "host-a", [tiny_model], data_dir, runner_lanes=2
    )
    wait_runner_ready(store, worker)
    with serving(api_settings(redis_server.url, [tiny_model])) as api:
        yield Stack(redis=redis_server, store=store, worker=worker, api=api)


@pytest.fixture(scope="session")
def fleet(
    redis_server: RedisServer,
    store: Store,
    session_processes: Processes,
    tmp_path_factory: pytest.TempPathFactory,
) -> TwoHosts:
    from exo_tasks.modelgen import create_model

    models = tmp_path_factory.mktemp("fleet-models")
    alpha, beta = create_model("tiny", models / "alpha"), create_model("tiny", models / "beta")
    data_dir = tmp_path_factory.mktemp("fleet")
    x = start_worker(
        session_processes, redis_server.url, "fleet-x", [alpha], data_dir, worker_concurrency=1
    )
    y = start_worker(session_processes, redis_server.url, "fleet-y", [alpha, beta], data_dir)
    for worker, model in ((x, "alpha"), (y, "alpha"), (y, "beta")):
        wait_runner_ready(store, worker, model)
    return TwoHosts(x=x, y=y)


@pytest.fixture(scope="module")
def flower(
    stack: Stack, fleet: TwoHosts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Flower]:
    """Flower beside the stack and the fleet, with basic auth (tests.support.flower.AUTH)."""
    workers = ("exo@fleet-x", "exo@fleet-y")
    yield from running_flower(stack, tmp_path_factory.mktemp("flower"), workers)


@pytest.fixture(scope="module")
def pair(
    redis_server: RedisServer,
    store: Store,
    chat_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pair]:
    """Workers a and b and an instance of the chat model over them, Ready: one per module
    (its tests break and restart it)."""
    data_dir = tmp_path_factory.mktemp("instance-pair")
    with running_pair(redis_server.url, store, data_dir, chat_model) as pair:
        yield pair


@pytest.fixture
def local_stack(processes: Processes, tmp_path: Path) -> Iterator[LocalStack]:
    """A whole stack of the test's own, not started yet (`up`, `up_in_terminal`, `start`)."""
    data_dir = tmp_path / "var"
    stack = LocalStack(processes, data_dir, launcher_env(data_dir), tmp_path / "stack.log")
    yield stack
    if stack.terminal is not None:
        stack.terminal.close()


# The chaos suite's report, for the whole run: under pytest-xdist each worker's session sends
# its cases to the controller, which writes them all once every worker is done.
RUN_REPORT = Report()


@pytest.fixture(scope="session")
def reliability(request: pytest.FixtureRequest) -> Iterator[Report]:
    """The chaos cases of this session, written to tests.support.report.REPORT (untracked;
    `make reliability-report` publishes it)."""
    report = Report()
    yield report
    workeroutput = getattr(request.config, "workeroutput", None)
    if workeroutput is None:
        report.write()
    else:
        workeroutput["reliability"] = report.as_data()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    RUN_REPORT.extend(getattr(node, "workeroutput", {}).get("reliability", []))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workeroutput"):  # the controller (or a run without xdist)
        RUN_REPORT.write()
