"""The `exo-tasks` command (`main`): run the stack or one of its processes, make models, and
submit, follow and list work through the HTTP API.

- `main`: the parser and the stack's commands; `jobs`: `submit` and `cancel`; `batch`:
  `exo-tasks batch ...`; `instances`: `exo-tasks instances ...`; `client`: the API client;
  `table`: listings as aligned columns.
"""

__all__ = ["batch", "client", "instances", "jobs", "main", "table"]
