"""The stored form of log probabilities: the float32 each was computed in, in the fewest digits
that give it back, as numpy shows a float32 (exo_tasks.wire computes it without numpy)."""

from __future__ import annotations

import math
import random
import struct

import numpy as np

from exo_tasks.wire import STORED, TokenLogprob, TopLogprob, _float32


def numpy_shows(value: float) -> float:
    return float(str(np.float32(value)))


def float32s() -> list[float]:
    """Every power of two of float32's range and the float32s beside it (where the shortest
    form is hardest to find), and random float32s and log probabilities."""
    chosen: list[float] = [0.0, -0.0, math.inf, -math.inf]
    for exponent in range(-149, 128):
        (bits,) = struct.unpack("I", struct.pack("f", 2.0**exponent))
        for step in range(-3, 4):
            if 0 <= bits + step < 0x7F800000:
                (single,) = struct.unpack("f", struct.pack("I", bits + step))
                chosen += [single, -single]
    rng = random.Random(32)
    for _ in range(20_000):
        (single,) = struct.unpack("f", struct.pack("I", rng.getrandbits(31)))
        chosen += [single, -single, -rng.expovariate(0.3)]
    return [value for value in chosen if not math.isnan(value)]


def test_float32_is_shown_as_numpy_shows_it() -> None:
    differ = [
        (value, _float32(value), numpy_shows(value))
        for value in float32s()
        if repr(_float32(value)) != repr(numpy_shows(value))
    ]
    assert not differ, differ[:10]


def test_log_probabilities_are_stored_as_float32() -> None:
    top = TopLogprob(token="a", logprob=-2.302585124969482, bytes=[97])
    token = TokenLogprob(token="b", logprob=-0.1, bytes=[98], top_logprobs=[top])
    stored: object = token.model_dump(context=STORED)  # the serializer's list, not a dict
    assert stored == ["b", -0.1, [["a", -2.3025851]]]
