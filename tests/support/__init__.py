"""The test harness that tests and benchmarks import: real processes (`processes`), workers
(`workers`), the API on a real port (`api`), server-sent events (`sse`) and the OpenAI client
(`clients`). Fixtures stay in tests/conftest.py."""
