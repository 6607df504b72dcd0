"""Walking a state machine's transitions table (status → the statuses it may move to), as the
unit tests of each table do."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

S = TypeVar("S", bound=Hashable)


def reachable(transitions: Mapping[S, frozenset[S]], start: S) -> set[S]:
    """Every status a sequence of moves from `start` can reach, `start` included."""
    reached, frontier = {start}, [start]
    while frontier:
        for to in transitions[frontier.pop()] - reached:
            reached.add(to)
            frontier.append(to)
    return reached
