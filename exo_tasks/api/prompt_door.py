"""The API's door for prompts: one over EXO_MAX_PROMPT_TOKENS for certain, counted with the
model's own tokenizer (exo_tasks.prompt_tokens, no MLX), is a 422 naming its field before
anything is stored, queued or streamed; so is a `top_k` or `logit_bias` past the tokenizer's
vocabulary. What the door cannot judge (a model whose tokenizer
this host cannot read, a chat template's own tokens near the cap) the runner still refuses.

Counting costs CPU: 100,000 characters take 20-40 ms (2-core x86, the `chat` preset's BPE).
Under gunicorn's gevent worker a greenlet that counts holds the whole process, so a long
prompt is counted on one real thread per process (the tokenizer lets go of the GIL: the hub
serves every other connection meanwhile) and a flood of them queues there, while a short one,
a fraction of a millisecond, is counted at once and never waits behind them. Under a threaded
server too: counted in each request's own thread, a flood of 150 took every core of the
machine, and a stream beside it waited over a second for a token.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gevent import monkey

from config.settings import Settings
from exo_tasks import prompt_tokens
from exo_tasks.errors import InvalidRequest
from exo_tasks.naming import find_model, model_slug
from exo_tasks.types import JobRequest

# Prompts longer than this are counted on the process's counting thread (about 1 ms of CPU).
INLINE_CHARS = 4096
COUNTING_THREADS = 1


class PromptDoor:
    def __init__(self, settings: Settings) -> None:
        self.cap = settings.max_prompt_tokens
        self.default_model = settings.served_models[0]
        # Read as the process starts, once per model (a real model's tokenizer.json takes
        # 0.1-0.5 s): ApiContext builds nothing on a first request.
        self.tokenizers = {model_slug(p): prompt_tokens.load(p) for p in settings.served_models}
        # As the runner counts it (mlx-lm's tokenizer: the vocabulary with its added tokens),
        # counted without a Python dict of the whole vocabulary.
        self.vocab_sizes = {
            name: tokenizer.get_vocab_size(with_added_tokens=True)
            for name, tokenizer in self.tokenizers.items()
            if tokenizer is not None
        }
        self.offload = _offloader()

    def check(self, request: JobRequest) -> None:
        """422 naming `prompt` or `messages` if the request's prompt is over the cap for
        certain, or naming `top_k` or `logit_bias` if they reach past the model's vocabulary;
        nothing if it is not, or if this door cannot tell."""
        name = find_model(request.model or self.default_model, self.tokenizers)
        tokenizer = self.tokenizers.get(name) if name is not None else None
        if name is None or tokenizer is None:
            return
        refused = request.outside_vocabulary(self.vocab_sizes[name])
        if refused is not None:
            field, why = refused
            raise InvalidRequest(f"{field}: {why}", [{"field": field, "message": why}])
        args = (tokenizer, request.prompt, request.messages, self.cap)
        chars = sum(len(m.content) for m in request.messages or []) + len(request.prompt or "")
        try:
            if chars <= INLINE_CHARS:
                prompt_tokens.check(*args)
            else:
                self.offload(prompt_tokens.check, *args)
        except prompt_tokens.PromptTooLong as exc:
            raise InvalidRequest(
                f"{exc.field}: {exc}",
                [{"field": exc.field, "message": str(exc), "tokens": exc.tokens, "limit": exc.cap}],
            ) from exc


def _offloader() -> Callable[..., Any]:
    """How a long prompt is counted: on COUNTING_THREADS real threads of the process, gevent's
    thread pool under gunicorn's gevent worker, else (a threaded server) a pool of our own."""
    if not monkey.is_module_patched("threading"):
        counting = ThreadPoolExecutor(COUNTING_THREADS, thread_name_prefix="prompt-count")
        return lambda fn, *args: counting.submit(fn, *args).result()
    from gevent.threadpool import ThreadPool

    pool = ThreadPool(COUNTING_THREADS)
    return lambda fn, *args: pool.apply(fn, args)
