"""The worker's import graph: no web layer (Flask, Werkzeug, exo_tasks.api) and no MLX in the
worker's main process or its pool children (MLX is the runner process's alone)."""

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
