"""Each job's own sampling inside one shared batch, on the real tiny model: penalties, logit
bias, top-k and min-p, log probabilities, and tool calls out of the output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors

from exo_tasks.runner.engine import BatchEngine
from exo_tasks.runner.toolcalls import ToolCallSplitter
from exo_tasks.types import ChatMessage, SamplingParams
from exo_tasks.wire import Tool
from tests.support.engine import Run
from tests.support.toolmodel import CALL, create_tool_model

PROMPT = "The quick brown fox"
# Settings that each change the greedy text of PROMPT (checked below), one per job.
PROCESSED: dict[str, dict[str, Any]] = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.5},
    "bias": {"logit_bias": {"40": 8.0, "50": -100.0}},
    "all": {"presence_penalty": -1.0, "frequency_penalty": 0.3, "logit_bias": {"30": 3.0}},
}


def run_alone(engine: BatchEngine, prompt: str, **params: Any) -> Run:
    run = Run(engine)
    run.add("alone", prompt, **params)
    run.until_done()
    return run


def mlx_lm_alone(tiny_loaded: tuple[Any, Any], prompt: str, max_tokens: int, **params: Any) -> str:
    """mlx-lm's own single-request generation with the same processors (greedy)."""
    model, tokenizer = tiny_loaded
    bias = {int(k): v for k, v in params.get("logit_bias", {}).items()}
    processors = make_logits_processors(
        bias or None,
        params.get("repetition_penalty"),
        20,
        params.get("presence_penalty"),
        20,
        params.get("frequency_penalty"),
        20,
    )
    prompt_tokens = tokenizer.encode(prompt)
    responses = stream_generate(
        model, tokenizer, prompt_tokens, max_tokens, logits_processors=processors
    )
    return "".join(r.text for r in responses)


@pytest.mark.parametrize("lanes", [1, 2])
def test_each_jobs_penalties_and_bias_in_one_batch_are_what_it_gets_alone(
    tiny_loaded: tuple[Any, Any], lanes: int
) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=lanes)
    try:
        common = {"max_tokens": 40, "ignore_eos": True}
        plain = run_alone(engine, PROMPT, **common).text("alone")
        alone = {
            name: run_alone(engine, PROMPT, **common, **p).text("alone")
            for name, p in PROCESSED.items()
        }
        run = Run(engine)
        run.add("plain", PROMPT, **common)
        for name, params in PROCESSED.items():
            run.add(name, PROMPT, **common, **params)
        run.until_done()
        assert engine.largest_batch == len(PROCESSED) + 1
        assert run.text("plain") == plain
        for name, params in PROCESSED.items():
            assert alone[name] != plain, f"{name} changes nothing: the test would prove nothing"
            assert run.text(name) == alone[name], name
            assert alone[name] == mlx_lm_alone(tiny_loaded, PROMPT, 40, **params), name
    finally:
        engine.close()


def test_top_k_and_min_p_filter_each_jobs_sampling(tiny_loaded: tuple[Any, Any]) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1)
    try:
        common: dict[str, Any] = {"max_tokens": 30, "ignore_eos": True}
        greedy = run_alone(engine, PROMPT, **common).text("alone")
        hot = {"temperature": 2.0, **common}
        # Keeping only the most likely token (top_k 1, or min_p 1) is greedy at any temperature.
        run = Run(engine)
        run.add("top_k", PROMPT, top_k=1, **hot)
        run.add("min_p", PROMPT, min_p=1.0, seed=3, **hot)
        run.add("free", PROMPT, seed=3, **hot)
        run.add("top_k_5", PROMPT, top_k=5, seed=4, **hot)
        run.until_done()
        assert run.text("top_k") == greedy and run.text("min_p") == greedy
        assert run.text("free") != greedy
        assert run.text("top_k_5") == run_alone(engine, PROMPT, top_k=5, seed=4, **hot).text(
            "alone"
        )
    finally:
        engine.close()


def test_logprobs_are_mlx_lms_for_each_token(tiny_loaded: tuple[Any, Any]) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1)
    try:
        run = Run(engine)
        run.add("lp", PROMPT, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
        run.add("none", PROMPT, max_tokens=12, ignore_eos=True)
        run.until_done()
        entries = [e for d in run.deltas["lp"] for e in d.logprobs]
        assert not any(d.logprobs for d in run.deltas["none"])
        model, tokenizer = tiny_loaded
        reference = list(stream_generate(model, tokenizer, tokenizer.encode(PROMPT), 12))
        assert [e.token for e in entries] == [r.text for r in reference]
        for entry, r in zip(entries, reference, strict=True):
            assert entry.logprob == pytest.approx(r.logprobs[r.token].item(), abs=1e-4)
            assert entry.bytes == list(entry.token.encode())
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert entry.top_logprobs[0].token == entry.token  # greedy takes the likeliest
            assert tops[0] == pytest.approx(mx.max(r.logprobs).item(), abs=1e-4)
    finally:
        engine.close()


def test_settings_the_vocabulary_rules_out_are_refused(tiny_loaded: tuple[Any, Any]) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1)
    try:
        tokens = engine.encode(PROMPT, None)
        with pytest.raises(ValueError, match="top_k"):
            engine.add("k", tokens, SamplingParams.model_validate({"temperature": 1, "top_k": 99}))
        with pytest.raises(ValueError, match="logit_bias"):
            engine.add("b", tokens, SamplingParams.model_validate({"logit_bias": {"500": 1}}))
        assert engine.active_jobs == 0
        assert run_alone(engine, PROMPT, max_tokens=5).last("alone").finish_reason is not None
    finally:
        engine.close()


def test_tool_calls_are_split_from_text_as_it_streams() -> None:
    def parse(text: str, tools: Any) -> Any:
        import json

        return json.loads(text)

    splitter = ToolCallSplitter("<tc>", "</tc>", parse, [])
    stream = 'Sure. <tc>{"name": "f", "arguments": {"x": 1}}</tc> and <t'
    pieces = [splitter.feed(ch, final=False) for ch in stream]
    text = "".join(p[0] for p in pieces)
    calls = [c for p in pieces for c in p[1]]
    assert text == "Sure.  and "  # "<t" may still grow into a marker: held back
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"x": 1}')]
    assert calls[0].id.startswith("call_")
    assert splitter.feed("ail", final=True) == ("<tail", [])
    cut = ToolCallSplitter("<tc>", "</tc>", parse, [])
    assert cut.feed('<tc>{"name": "g"', final=True) == ("", [])  # cut mid-call: no call


def test_a_tool_model_calls_its_tool_only_when_given_tools(tmp_path: Path) -> None:
    model, tokenizer = load(str(create_tool_model(tmp_path / "tools")))[:2]
    engine = BatchEngine(model, tokenizer, lanes=1)
    try:
        assert engine.tool_calling
        spec = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        tools = [Tool.model_validate(spec)]
        chat = [ChatMessage(role="user", content="Weather in Paris?")]
        prompt = engine.encode(None, chat, tools)
        assert "get_weather" in tokenizer.decode(prompt)
        run = Run(engine)
        engine.add("tools", prompt, SamplingParams.model_validate({"tools": [spec]}))
        engine.add(
            "none", prompt, SamplingParams.model_validate({"tools": [spec], "tool_choice": "none"})
        )
        run.deltas = {"tools": [], "none": []}
        run.until_done()
        calls = [c for d in run.deltas["tools"] for c in d.tool_calls]
        assert run.text("tools") == "" and run.last("tools").finish_reason == "stop"
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (CALL["name"], '{"city": "Paris"}')
        ]
        assert run.text("none").startswith("<tool_call>{")
    finally:
        engine.close()


def test_tools_for_a_model_without_tool_support_are_refused(tiny_loaded: tuple[Any, Any]) -> None:
    engine = BatchEngine(*tiny_loaded, lanes=1)
    try:
        spec = {"type": "function", "function": {"name": "f"}}
        with pytest.raises(ValueError, match="no tool support"):
            engine.encode(
                None, [ChatMessage(role="user", content="hi")], [Tool.model_validate(spec)]
            )
    finally:
        engine.close()
