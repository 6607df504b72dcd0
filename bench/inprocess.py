"""The baseline with no queue: `mlx_lm.stream_generate` called in process.

Run as its own process (`python -m bench.inprocess MODEL COUNT REPEATS`), so MLX never runs in
the bench process itself; prints one JSON list of latencies (ms) per repeat.
"""

from __future__ import annotations

import json
import sys
import time

from bench.load import prompt_for


def main(model_dir: str, count: int, repeats: int) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)[:2]
    for _ in mlx_lm.stream_generate(model, tokenizer, "warmup", max_tokens=4):
        pass
    rounds = []
    for repeat in range(repeats):
        latencies = []
        for request in range(count):
            prompt = prompt_for(0, request, f"overhead {repeat}")
            started = time.perf_counter()
            for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=1):
                pass
            latencies.append((time.perf_counter() - started) * 1000)
        rounds.append(latencies)
    print(json.dumps(rounds))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
