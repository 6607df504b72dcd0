"""A forked child keeps its parent's pages shared through its cycle collector's passes
(exo_tasks.forks: the worker's pool children and batch feeder, gunicorn's workers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a fresh interpreter: hold ~30 MiB of collectable objects, fork, and in the child run a
# full collection, as a child's own collector does sooner or later; report the pages it made
# its own meanwhile and whether each side is frozen.
PROBE = """
import gc, json, os, sys
from exo_tasks import forks

def private_dirty_mib():
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024

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


def probe(mode: str) -> dict[str, float]:
    shown = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, float] = json.loads(shown.stdout)
    return result


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps_rollup")
def test_a_forked_childs_collection_leaves_the_parents_pages_shared() -> None:
    plain, frozen = probe("plain"), probe("frozen")
    # Without the hook, the child's pass made the pages of what it inherited its own.
    assert plain["copied_mib"] > 10, plain
    assert frozen["copied_mib"] < 2, frozen
    assert frozen["frozen"] > 300_000, frozen  # the child: what it inherited, frozen
    assert frozen["parent_frozen"] > 300_000, frozen  # and the parent: its next fork shares them
