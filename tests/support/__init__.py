"""The test harness that tests and benchmarks import, one family: real processes
(`processes`), workers (`workers`), the shared stack and fleet (`stack`), the whole stack under
`exo-tasks up` (`launcher`), a command in a real pseudo-terminal (`terminal`), the `exo-tasks`
command run to its end (`cli`), the API on a real port (`api`), server-sent events (`sse`),
the OpenAI client (`clients`), the fixtures that start them (`fixtures`, which
tests/conftest.py loads), and which pytest-xdist process runs which module (`lanes`). Tests
import from here, never from tests/conftest.py or from another test module."""
