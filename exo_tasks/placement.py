"""Whether an instance's placement can work, decided before any host starts a rank: the model
is known, mlx-lm can split it that way, into that many ranks. The model's `config.json` and
mlx-lm's model code are read as files: the API imports no MLX.

A model is a local directory with a `config.json`, a model of this process's EXO_MODELS named by
its slug, or a hub id already in the local Hugging Face cache. What each rank loads is the path
(it must be the same on every host, as with `mlx.launch`) or the hub id.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from exo_tasks.errors import InvalidRequest, NotFound
from exo_tasks.instances import Parallel
from exo_tasks.naming import find_model, is_local_path, model_path, model_slug

CONFIG = "config.json"


@dataclass(frozen=True)
class ModelSource:
    """A model as its ranks load it (`path`: a directory or a hub id) and its config."""

    path: str
    config: dict[str, Any]


def find_source(name: str, served_models: list[str]) -> ModelSource:
    """The model `name` names, with its config; 404 naming where it was looked for."""
    served = {model_slug(m): m for m in served_models}
    candidates = [name]
    if (slug := find_model(name, served)) is not None:
        candidates.append(served[slug])
    for candidate in candidates:
        config = _local_config(candidate) or _hub_config(candidate)
        if config is not None:
            return ModelSource(str(candidate), _read_config(config, name))
    raise NotFound(
        f"unknown model '{name}': no {CONFIG} in a directory of that name, no model of this "
        f"host's EXO_MODELS by that name ({', '.join(served) or 'none'}), nor a download of "
        "it in the Hugging Face cache",
        {"field": "model"},
    )


def _local_config(candidate: str) -> Path | None:
    path = model_path(candidate) / CONFIG
    return path if is_local_path(candidate) and path.is_file() else None


def _hub_config(candidate: str) -> Path | None:
    if is_local_path(candidate) or candidate.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache  # 0.8 s to import: only for hub ids

    try:
        found = try_to_load_from_cache(candidate, CONFIG)
    except ValueError:  # no valid hub id (HFValidationError): no model of that name
        return None
    return Path(found) if isinstance(found, str) else None


def _read_config(path: Path, name: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        message = f"model '{name}': {path} is unreadable: {exc}"
        raise InvalidRequest(message, {"field": "model"}) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InvalidRequest(f"model '{name}': {path} names no model_type", {"field": "model"})
    return config


@cache
def model_splits(model_type: str) -> frozenset[Parallel]:
    """How mlx-lm can split a model of `model_type`: `tensor` where its model has `shard`,
    `pipeline` where it has `pipeline` (mlx-lm's Llama has only `shard`). Read from the
    installed mlx-lm's source, so it follows the version that the ranks run."""
    package = importlib.util.find_spec("mlx_lm")
    if package is None or not package.submodule_search_locations:
        return frozenset()
    root = Path(next(iter(package.submodule_search_locations)))
    source = root / "models" / f"{_remapped(root, model_type)}.py"
    text = source.read_text() if source.is_file() else ""
    splits: set[Parallel] = set()
    if "def shard(" in text:
        splits.add("tensor")
    if "def pipeline(" in text or "PipelineMixin" in text:
        splits.add("pipeline")
    return frozenset(splits)


def _remapped(root: Path, model_type: str) -> str:
    """mlx-lm's module for `model_type` (its MODEL_REMAPPING: 'mistral' runs as 'llama')."""
    import ast

    tree = ast.parse((root / "utils.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets
        ):
            remapping: dict[str, str] = ast.literal_eval(node.value)
            return remapping.get(model_type, model_type)
    return model_type


def check_split(name: str, config: dict[str, Any], parallel: Parallel, ranks: int) -> None:
    """422 naming why `ranks` ranks cannot hold the model split `parallel`."""
    model_type = config["model_type"]
    if parallel not in model_splits(model_type):
        has = " and ".join(sorted(model_splits(model_type))) or "no split at all"
        method = "shard" if parallel == "tensor" else "pipeline"
        raise InvalidRequest(
            f"model '{name}' cannot be split {parallel}-parallel: mlx-lm's {model_type} model "
            f"has no `model.{method}` (it has {has})",
            {"field": "parallel"},
        )
    if parallel == "tensor":
        _check_heads(name, config, ranks)
    else:
        layers = config.get("num_hidden_layers")
        if isinstance(layers, int) and ranks > layers:
            raise InvalidRequest(
                f"model '{name}' has {layers} layers: too few for {ranks} pipeline ranks",
                {"field": "hosts"},
            )


def _check_heads(name: str, config: dict[str, Any], ranks: int) -> None:
    """Tensor parallel gives each rank an equal share of the attention heads and of the key
    and value heads (mlx-lm's `shard` divides both by the group's size)."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    counts = {"attention heads": heads, "key/value heads": kv_heads}
    for what, count in counts.items():
        if isinstance(count, int) and count % ranks:
            raise InvalidRequest(
                f"model '{name}' has {count} {what}: {ranks} tensor-parallel ranks cannot share "
                f"them evenly (use a number of hosts that divides {count})",
                {"field": "hosts"},
            )
