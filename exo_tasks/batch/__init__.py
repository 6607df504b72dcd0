"""OpenAI's Batch API on the queue: a batch's lines run as low-priority jobs, fed at the
fleet's pace.

- `input`: an input file checked and read by one parser; `jobs`: a line as a job; `results`:
  how each line ends in the output or error file.
- `feeder`: drives every open batch; `process`: the feeder's own process beside each worker.

The Files and Batch objects are exo_tasks.batch_types and a batch's state machine is in
exo_tasks.lifecycle: the store keeps them, and batch/ uses the store.

No module here imports Flask or `exo_tasks.api`: the worker runs them.
"""

__all__ = ["feeder", "input", "jobs", "process", "results"]
