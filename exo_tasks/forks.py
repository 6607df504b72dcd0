"""Forked children that keep their parent's pages shared.

A child made by fork() shares every page with its parent until one of them writes to it.
Python's cycle collector writes to each object it visits, so a collection over the objects a
child inherited made the pages holding them its own, in each child: the worker's 34 pool
children held ~14 MiB each of the worker's pages. The parent's collections do the same harm:
the children it forks one after another then hold different copies of every page it wrote in
between. Frozen (`gc.freeze`), those objects are left out of every collection, the parent's
and each child's.
"""

from __future__ import annotations

import functools
import gc
import os


@functools.cache
def freeze_at_fork() -> None:
    """From now on, each fork of this process first freezes every object it holds: the
    pool's children and their replacements, a forked helper, gunicorn's workers. What is made
    afterwards is collected as before; what existed at a fork never is (a process that forks
    does so at its start, or to replace a child: it holds little garbage then)."""
    os.register_at_fork(before=gc.freeze)
