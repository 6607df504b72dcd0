"""Shared fixtures: a real tiny model on disk (more fixtures join as the suite grows)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exo_tasks.modelgen import create_model

    return create_model("tiny", tmp_path_factory.mktemp("models") / "tiny")
