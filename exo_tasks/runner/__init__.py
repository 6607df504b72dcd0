"""The runner: one process per (host, model), the single owner of a loaded model.

- `main`: the spawned process's entry point; `process`: its spec, the progress it shares with
  the supervisor, its engine factory and exit codes; `loop`: the batching loop (lifecycle,
  commands, bursts, steps, stopping); `in_flight`: the jobs in the batch (admitted or refused,
  ended, requeued, expired); `intake`: its inbox read by a thread of its own, a prompt over the
  token cap for certain refused there.
- `active_job`, `outbox`, `step_writer`: a job in the batch, what the runner owes Redis, and
  the thread that writes each step's share of it.
- `engine`, `lane`, `lane_threads`: continuous batching over mlx-lm's `BatchGenerator`;
  `prefill_pace`, `prefiller`: on the CPU, prefill beside decoding jobs (paced in time, or in a
  process of its own); `first_token`: a job's first token outside its lane's generator (the
  prefill process's, or one pass for a lone 1-token job).
- `sampling`, `prompt_cache`, `toolcalls`, `keep_alive`: a job's own sampling, the prompt
  cache, its prompt through the chat template and tool calls out of its text, when an idle
  runner unloads.
- `rank`, `ring`, `schedule`: a rank of an instance (its ring over `mx.distributed`, its
  shard, the loop of a rank other than 0) and rank 0's schedule, shared with the others.

Only the runner process imports `engine`, `first_token`, `lane`, `sampling` and `schedule`
(they load MLX); the worker's main process imports `main` and `process` to spawn it.
"""

__all__ = [
    "active_job",
    "engine",
    "first_token",
    "in_flight",
    "intake",
    "keep_alive",
    "lane",
    "lane_threads",
    "loop",
    "main",
    "outbox",
    "prefill_pace",
    "prefiller",
    "process",
    "prompt_cache",
    "rank",
    "ring",
    "sampling",
    "schedule",
    "step_writer",
    "toolcalls",
]
