"""The worker's import graph: no web layer (Flask, Werkzeug, exo_tasks.api) and no MLX in the
worker's main process or its pool children (MLX is the runner process's alone). And the
launcher's and `exo-tasks redis`'s: they stay up as long as the stack, so what they import is
memory held for as long."""

from __future__ import annotations

import json
import subprocess
import sys

SHOW_LOADED = (
    "import json, sys, exo_tasks.worker.app; "
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('flask', 'werkzeug', 'mlx', 'mlx_lm') or m.startswith('exo_tasks.api'))))"
)


def test_the_worker_loads_neither_the_web_layer_nor_mlx() -> None:
    # A fresh interpreter: this test process has imported whatever other tests needed.
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_LOADED], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(shown.stdout) == []


SHOW_LAUNCHER_LOADED = (
    "import json, sys, exo_tasks.cli.main, exo_tasks.launcher; "
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('redis', 'celery', 'kombu') or m in ('exo_tasks.types', 'exo_tasks.wire'))))"
)


def test_the_launcher_loads_neither_redis_py_nor_the_job_models() -> None:
    # ~25 MiB of a process that does neither: it starts the stack's processes and stops them.
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_LAUNCHER_LOADED],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(shown.stdout) == []
