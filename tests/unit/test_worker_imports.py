"""The worker's import graph: no web layer (Flask, Werkzeug, exo_tasks.api) and no MLX in the
worker's main process or its pool children (MLX is the runner process's alone), nor the
runner's other libraries (numpy, the tokenizer's). And the launcher's and `exo-tasks redis`'s:
they stay up as long as the stack, so what they import is memory held for as long."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from config.settings import DEFAULT_PRESET
from exo_tasks.modelgen import is_made

SHOW_LOADED = (
    "import json, sys, exo_tasks.worker.app, exo_tasks.cli.main, exo_tasks.modelgen; "
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('flask', 'werkzeug', 'mlx', 'mlx_lm', 'numpy', 'tokenizers') "
    "or m.startswith('exo_tasks.api'))))"
)
SHOW_LAUNCHER_LOADED = (
    "import json, sys, exo_tasks.cli.main, exo_tasks.launcher; "
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('redis', 'celery', 'kombu') or m in ('exo_tasks.types', 'exo_tasks.wire'))))"
)
SHOW_MAKER_LOADED = (
    "import json, sys, pathlib; from exo_tasks.cli.main import _ensure_default_model; "
    "_ensure_default_model(pathlib.Path(sys.argv[1])); "
    "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
    "('numpy', 'tokenizers', 'safetensors'))))"
)


def loaded(code: str, *args: str) -> list[str]:
    """What `code` prints, in a fresh interpreter: this test process has imported whatever
    other tests needed."""
    shown = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules: list[str] = json.loads(shown.stdout)
    return modules


def test_the_worker_loads_neither_the_web_layer_nor_the_runners_libraries() -> None:
    # What the worker's main process imports, its 34 pool children and its batch feeder
    # share; numpy and the tokenizer's library were ~10 MiB of it (and an OpenBLAS thread).
    assert loaded(SHOW_LOADED) == []


def test_the_launcher_loads_neither_redis_py_nor_the_job_models() -> None:
    # ~25 MiB of a process that does neither: it starts the stack's processes and stops them.
    assert loaded(SHOW_LAUNCHER_LOADED) == []


def test_the_worker_makes_the_default_model_in_a_process_of_its_own(tmp_path: Path) -> None:
    # `exo-tasks worker` with no EXO_MODELS makes the default model on its first start.
    directory = tmp_path / "models" / "chat"
    assert loaded(SHOW_MAKER_LOADED, str(directory)) == []
    assert is_made(DEFAULT_PRESET, directory)
