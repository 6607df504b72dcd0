"""Which splits a model type has, read from the installed mlx-lm's source, and the 422 of a
placement that cannot split the model (exo_tasks.placement): pure, no Redis, no MLX."""

from __future__ import annotations

import pytest

from exo_tasks.errors import InvalidRequest
from exo_tasks.placement import check_split, model_splits

LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}


def test_llama_has_tensor_only_and_mistral_runs_as_llama() -> None:
    assert model_splits("llama") == {"tensor"}
    assert model_splits("mistral") == {"tensor"}  # mlx-lm's MODEL_REMAPPING


def test_a_model_that_supports_neither_split_is_refused_naming_it() -> None:
    assert model_splits("gpt2") == frozenset()
    with pytest.raises(InvalidRequest) as refused:
        check_split("m", {"model_type": "gpt2", "num_attention_heads": 4}, "tensor", 2)
    assert str(refused.value) == (
        "model 'm' cannot be split tensor-parallel: mlx-lm's gpt2 model has no `model.shard` "
        "(it has no split at all)"
    )


def test_tensor_ranks_must_divide_the_heads() -> None:
    check_split("m", LLAMA, "tensor", 2)
    with pytest.raises(InvalidRequest, match="2 key/value heads: 4 tensor-parallel ranks"):
        check_split("m", LLAMA, "tensor", 4)
