"""A forked child keeps its parent's pages shared through its cycle collector's passes
(exo_tasks.forks: the worker's pool children and batch feeder, gunicorn's workers), and a pool
child starts on a store made before the fork (ExoCelery.prepare_forks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The head of each probe: what a process holds that no other does, in MiB.
PRIVATE_DIRTY = """
import gc, json, os, sys

def private_dirty_mib():
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
"""
# In a fresh interpreter: hold ~30 MiB of collectable objects, fork, and in the child run a
# full collection, as a child's own collector does sooner or later; report the pages it made
# its own meanwhile and whether each side is frozen.
COLLECTION = """
from exo_tasks import forks

held = [[i] for i in range(300_000)]
if sys.argv[1] == "frozen":
    forks.freeze_at_fork()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    before = private_dirty_mib()
    gc.collect()
    report = {"copied_mib": private_dirty_mib() - before, "frozen": gc.get_freeze_count()}
    os.write(write, json.dumps(report).encode())
    os._exit(0)
os.close(write)
child = json.loads(os.read(read, 1 << 16))
os.waitpid(pid, 0)
print(json.dumps({**child, "parent_frozen": gc.get_freeze_count()}))
"""
# In a fresh interpreter: the worker's app (no Redis needed: nothing connects), a child forked
# as the pool's are, which runs what a pool child runs at its start (worker_process_init: it
# takes a store of its own); report what it copied meanwhile.
CHILD_START = """
from celery.signals import worker_process_init
from config.settings import Settings
from exo_tasks import forks
from exo_tasks.worker.app import create_worker_app

settings = Settings(redis_url="redis://127.0.0.1:9/0", hostname="probe", _env_file=None)
app = create_worker_app(settings)
app.set_current()
forks.freeze_at_fork()
if sys.argv[1] == "prepared":
    app.prepare_forks()
inherited = app.store
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    before = private_dirty_mib()
    worker_process_init.send(sender=None)
    report = {"copied_mib": private_dirty_mib() - before, "renewed": app.store is not inherited}
    os.write(write, json.dumps(report).encode())
    os._exit(0)
os.close(write)
print(os.read(read, 1 << 16).decode())
os.waitpid(pid, 0)
"""


def probe(code: str, mode: str) -> dict[str, float]:
    shown = subprocess.run(
        [sys.executable, "-c", PRIVATE_DIRTY + code, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, float] = json.loads(shown.stdout)
    return result


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps_rollup")
def test_a_forked_childs_collection_leaves_the_parents_pages_shared() -> None:
    plain, frozen = probe(COLLECTION, "plain"), probe(COLLECTION, "frozen")
    # Without the hook, the child's pass made the pages of what it inherited its own.
    assert plain["copied_mib"] > 10, plain
    assert frozen["copied_mib"] < 2, frozen
    assert frozen["frozen"] > 300_000, frozen  # the child: what it inherited, frozen
    assert frozen["parent_frozen"] > 300_000, frozen  # and the parent: its next fork shares them


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps_rollup")
def test_a_pool_child_takes_a_store_made_before_the_fork() -> None:
    # 34 children: each MiB a child copies as it starts is 34 MiB of a worker host.
    made_in_child = probe(CHILD_START, "unprepared")
    prepared = probe(CHILD_START, "prepared")
    assert made_in_child["renewed"] and prepared["renewed"]
    # Made in the child, the store's construction wrote ~1 MiB more of the parent's pages
    # (1.9 MiB against 0.9, with the rest of the child's start).
    assert made_in_child["copied_mib"] - prepared["copied_mib"] > 0.6, (made_in_child, prepared)
