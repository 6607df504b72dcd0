"""A model that calls a tool: the tiny Llama with a chat template that takes tools and weights
that make greedy decoding write one fixed call after the assistant's turn begins.

A random model never writes a well-formed call, and no tool-calling model can be downloaded
here. This one is still real for every part under test: mlx-lm loads it, infers its tool
parser from its template (`json_tools`), renders the request's tools into its prompt, and the
call is decoded token by token like any output. Its layers are zeroed, so each next token
depends on the current one only (a bigram table written into `lm_head`): after the newline
that opens the assistant's turn it writes `<tool_call>`, the call, `</tool_call>`, then ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from exo_tasks.modelgen import EOS, create_model

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = json.dumps(CALL)
START, END = "<tool_call>", "</tool_call>"
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n"
    'Call one as <tool_call>{"name": tool_call.name, "arguments": tool_call.arguments}'
    "</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}{% set tool_call = call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LOGIT = 10.0  # the scripted token's logit is this times sqrt(hidden); the others' stay near 0


def create_tool_model(directory: Path) -> Path:
    create_model("tiny", directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([START, CALL_TEXT, END])
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["vocab_size"] = len(vocab)
    tokenizer_config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["chat_template"] = TOOL_TEMPLATE
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2))
    chain = [("\n", START), (START, CALL_TEXT), (CALL_TEXT, END), (END, EOS)]
    weights = _scripted(load_file(str(directory / "model.safetensors")), vocab, chain)
    save_file(weights, str(directory / "model.safetensors"), {"format": "pt"})
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def _scripted(
    weights: dict[str, np.ndarray], vocab: dict[str, int], chain: list[tuple[str, str]]
) -> dict[str, np.ndarray]:
    """Zero every layer's output (the residual stream stays the current token's embedding)
    and make `lm_head` map each token of `chain` to its successor."""
    rng = np.random.default_rng(1)
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    extra = len(vocab) - embed.shape[0]
    embed = np.concatenate([embed, rng.standard_normal((extra, hidden), np.float32)])
    out = {
        name: np.zeros_like(w) if name.endswith(("o_proj.weight", "down_proj.weight")) else w
        for name, w in weights.items()
    }
    head = np.zeros((len(vocab), hidden), np.float32)
    for current, successor in chain:
        row = embed[vocab[current]]
        head[vocab[successor]] += LOGIT * row / np.linalg.norm(row)
    out["model.embed_tokens.weight"] = embed
    out["lm_head.weight"] = head
    return out
