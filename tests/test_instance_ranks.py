"""An instance of the `chat` preset over two real workers (hosts a and b, one machine) gives the
text of the same model whole in one runner, byte for byte: greedy and seeded jobs in one batch
through /v1/jobs, a job's SSE stream, chat completions streamed or not; a cancel ends one job
and leaves its batch's other texts as they were; jobs joining a decoding batch and a next turn
that hits the prompt cache give the whole model's text too; on the `bench` preset each rank
holds at most 0.6x the whole model's weights, and reports at most that much MLX memory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil

from exo_tasks.modelgen import create_model
from exo_tasks.naming import instance_runner_id
from tests.support import sse
from tests.support.clients import CHAT, client_for
from tests.support.instances import START_TIMEOUT_S, Pair, place, submit
from tests.support.processes import wait_until
from tests.support.toolmodel import CALL, create_tool_model

BATCH: list[dict[str, Any]] = [
    {"prompt": "Hello there", "max_tokens": 40},
    {"prompt": "The quick brown fox", "max_tokens": 48, "temperature": 0.8, "seed": 11},
    {"prompt": "Hello there, again", "max_tokens": 32, "temperature": 1.0, "top_p": 0.9, "seed": 5},
    {"prompt": "abc", "max_tokens": 40, "stop": ["e"]},
    {
        "prompt": "logprobs please",
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    },
    {"messages": CHAT, "max_tokens": 24, "temperature": 0.7, "seed": 3},
]


def outcome(job: dict[str, Any]) -> tuple[Any, ...]:
    """What must match: its text, how it ended, its token counts (how much of its prompt the
    prompt cache held depends on when it arrived, which differs from runner to runner)."""
    usage = job["usage"]
    counts = (usage["prompt_tokens"], usage["completion_tokens"])
    return (job["status"], job["output"]["text"], job["output"]["finish_reason"], counts)


def run_batch(pair: Pair, model: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submitted together (they share the runner's batch), then waited for."""
    ids = [pair.api.submit(model=model, **request) for request in requests]
    return [pair.api.wait_job(job_id) for job_id in ids]


def test_jobs_in_one_batch_on_an_instance_equal_the_model_whole(pair: Pair) -> None:
    on_instance = run_batch(pair, "chat", BATCH)
    whole = run_batch(pair, "whole", BATCH)
    assert [outcome(j) for j in on_instance] == [outcome(j) for j in whole]
    assert all(j["status"] == "succeeded" for j in on_instance)
    assert sum(bool(j["output"]["text"]) for j in on_instance) >= 4, "texts worth comparing"
    assert {j["runner_id"] for j in on_instance} == {instance_runner_id(pair.instance_id, 0)}
    assert {j["runner_id"].split("@")[0] for j in whole} == {"whole"}
    assert on_instance[4]["output"]["logprobs"], "logprobs reported on an instance"
    rank0 = pair.store.runners.get(instance_runner_id(pair.instance_id, 0))
    assert rank0 is not None and rank0.largest_batch >= 2, "the jobs shared a batch"


def test_a_stream_and_chat_completions_on_an_instance_equal_the_model_whole(pair: Pair) -> None:
    request = {"prompt": "stream me", "max_tokens": 30}
    texts = []
    for model in ("chat", "whole"):
        job_id = pair.api.submit(model=model, **request)
        body = pair.api.get(f"/v1/jobs/{job_id}/stream").text
        events = sse.parse(body)
        assert events[-1]["event"] == "done", body[-500:]
        streamed = "".join(e["data"]["text"] for e in events if e["event"] == "token")
        assert streamed == events[-1]["data"]["output"]["text"]
        texts.append(streamed)
    assert texts[0] == texts[1] and texts[0]
    with client_for(pair.api) as client:
        chat: dict[str, Any] = {"messages": CHAT, "max_completion_tokens": 32, "seed": 9}
        answers = [client.chat.completions.create(model=m, **chat) for m in ("chat", "whole")]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        chunks = client.chat.completions.create(model="chat", stream=True, **chat)
        streamed_chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed_chat == answers[1].choices[0].message.content


# An idle rank's share of a core at most (one that waited on the ring took all of one).
IDLE_CPU_SHARE = 0.05


def busy_share(pids: list[int], over_s: float = 3.0) -> list[float]:
    """Each process's CPU time over `over_s`, as a share of one core."""
    processes = [psutil.Process(pid) for pid in pids]
    before = [sum(p.cpu_times()[:2]) for p in processes]
    time.sleep(over_s)
    return [(sum(p.cpu_times()[:2]) - b) / over_s for p, b in zip(processes, before, strict=True)]


def test_an_idle_instance_keeps_no_core_busy(pair: Pair) -> None:
    """mlx's ring polls its socket while a receive is pending: a follower that waited on the
    ring for rank 0's next plan kept a core busy for as long as the instance was idle. Idle,
    before a job and after it, every rank now takes a small share of a core, and the job
    after the idle time is the whole model's."""
    before = pair.wait_ready()
    pids = [pair.rank_pid(rank) for rank in range(len(before.ranks))]
    shares = busy_share(pids)
    assert max(shares) < IDLE_CPU_SHARE, f"idle ranks' shares of a core: {shares}"
    request = {"prompt": "after a rest", "max_tokens": 20, "ignore_eos": True}
    on_instance = run_batch(pair, "chat", [request])
    assert [outcome(j) for j in on_instance] == [
        outcome(j) for j in run_batch(pair, "whole", [request])
    ]
    shares = busy_share(pids)
    assert max(shares) < IDLE_CPU_SHARE, f"ranks' shares of a core after a job: {shares}"
    assert pair.instance().generation == before.generation


def test_jobs_that_join_a_decoding_batch_one_by_one_equal_the_model_whole(pair: Pair) -> None:
    """Each job added while the batch decodes: its plan goes out while the last step still
    computes (mlx-lm evaluates the next tokens asynchronously). On the model's own stream the
    plan waits for that step; on another one it overtook it, and rank 1 read the step's
    activations as a plan (a StepPlan that is not JSON: the instance failed)."""
    before = pair.instance()
    requests: list[dict[str, Any]] = [
        {"prompt": f"joining {i}", "max_tokens": 60, "ignore_eos": True} for i in range(3)
    ]

    def decoding(job_id: str) -> bool:
        record = pair.instance()
        assert record.status == "Ready", pair.explain(record)
        return pair.store.streams.streamed_text(job_id)[1] >= 3

    ids: list[str] = []
    for request in requests:
        ids.append(submit(pair, **request))
        wait_until(lambda: decoding(ids[-1]), 30, f"tokens of job {len(ids)}")
    jobs = [pair.api.wait_job(job_id) for job_id in ids]
    whole = run_batch(pair, "whole", requests)
    assert [outcome(j) for j in jobs] == [outcome(j) for j in whole]
    after = pair.instance()
    assert after.status == "Ready" and after.generation == before.generation, pair.explain(after)


def test_a_conversation_s_next_turn_hits_the_prompt_cache_on_an_instance(pair: Pair) -> None:
    """Rank 0 finds the conversation's first turn in its prompt cache, and every rank reuses
    its own cache alike (a rank that prefilled another length would wait on collectives the
    others never enter): most of the next turn's prompt is cached, its text is the whole
    model's, and the instance stays Ready."""
    before = pair.instance()
    system = {"role": "system", "content": "You answer in one line. " * 20}
    opening: list[dict[str, Any]] = [system, {"role": "user", "content": "cache me"}]
    nexts = []
    for model in ("chat", "whole"):
        first = pair.api.wait_job(pair.api.submit(model=model, messages=opening, max_tokens=8))
        reply = {"role": "assistant", "content": first["output"]["text"]}
        turn = [*opening, reply, {"role": "user", "content": "and again"}]
        nexts.append(pair.api.wait_job(pair.api.submit(model=model, messages=turn, max_tokens=8)))
        cached = nexts[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 1, (model, cached, first["usage"])
    assert outcome(nexts[0]) == outcome(nexts[1]) and nexts[0]["status"] == "succeeded"
    after = pair.instance()
    assert after.status == "Ready" and after.generation == before.generation, pair.explain(after)


def test_cancel_of_one_job_leaves_the_others_texts_unchanged(pair: Pair) -> None:
    requests: list[dict[str, Any]] = [
        {"prompt": f"job {i}", "max_tokens": 120, "ignore_eos": True} for i in range(3)
    ]
    # The middle job outlasts the cancel's way to it (a loaded machine once ended all 120
    # tokens first); the whole model is then run to the length it reached, as greedy text.
    requests[1]["max_tokens"] = 2000
    ids = [submit(pair, **request) for request in requests]
    wait_until(
        lambda: pair.store.streams.streamed_text(ids[1])[1] >= 5, 30, "tokens of the middle job"
    )
    assert pair.api.post(f"/v1/jobs/{ids[1]}/cancel").status_code == 202
    jobs = [pair.api.wait_job(job_id) for job_id in ids]
    assert jobs[1]["status"] == "cancelled"
    assert 5 <= jobs[1]["usage"]["completion_tokens"] < 2000
    requests[1]["max_tokens"] = jobs[1]["usage"]["completion_tokens"]
    whole = run_batch(pair, "whole", requests)
    assert jobs[1]["output"]["text"] == whole[1]["output"]["text"][: len(jobs[1]["output"]["text"])]
    for i in (0, 2):
        assert outcome(jobs[i]) == outcome(whole[i])
    assert pair.instance().status == "Ready"  # a cancel is no fault


def test_each_rank_holds_at_most_0_6_of_the_bench_model(pair: Pair, tmp_path: Path) -> None:
    bench = create_model("bench", tmp_path / "bench")
    instance_id = place(pair.api, bench)
    whole_bytes = (bench / "model.safetensors").stat().st_size  # the parameters, whole

    def ranks_loaded() -> list[int] | None:
        record = pair.store.instances.get(instance_id)
        assert record is not None and record.status != "Failed", record
        sizes = [r.weights_bytes for r in record.ranks]
        return [s for s in sizes if s] if record.status == "Ready" and all(sizes) else None

    sizes = wait_until(ranks_loaded, 180, "the bench instance Ready", 0.5)
    assert all(size <= 0.6 * whole_bytes for size in sizes), (sizes, whole_bytes)
    # The MLX memory each rank's model uses, as its runner reports it (its parameters and
    # buffers; a whole runner of this model reports about its parameters' size).
    record = pair.store.instances.get(instance_id)
    assert record is not None
    states = [pair.store.runners.get(r.runner_id) for r in record.ranks]
    memory = [s.memory_bytes for s in states if s is not None and s.memory_bytes]
    print(f"bench model {whole_bytes} bytes; per rank: weights {sizes}, MLX memory {memory}")
    assert len(memory) == 2 and all(m <= 0.6 * whole_bytes for m in memory), (memory, whole_bytes)
    assert pair.api.post(f"/v1/instances/{instance_id}/shutdown", json={"mode": "hard"})
    wait_until(
        lambda: (r := pair.store.instances.get(instance_id)) and r.status == "Shutdown", 30, "stop"
    )


def test_a_job_s_time_limit_and_keep_alive_on_an_instance(pair: Pair) -> None:
    """A job past its own time limit ends timed_out with its text so far, as on any runner; a
    job asking for keep_alive 0 does not unload a rank (one rank alone cannot leave)."""
    before = pair.instance()
    timed = submit(pair, prompt="slow", max_tokens=4000, ignore_eos=True, timeout_s=3)
    job = pair.api.wait_job(timed, 30)
    assert job["status"] == "timed_out" and job["output"]["finish_reason"] == "time_limit"
    assert job["output"]["text"]
    # The last job to end decides when an idle runner unloads: this one says at once.
    brief = submit(pair, prompt="brief", max_tokens=8, keep_alive=0)
    assert pair.api.wait_job(brief)["status"] == "succeeded"
    time.sleep(2)  # longer than keep_alive 0 takes to unload a whole runner
    rank0 = pair.store.runners.get(instance_runner_id(pair.instance_id, 0))
    assert rank0 is not None and rank0.status == "Ready", rank0
    after = pair.instance()
    assert after.status == "Ready" and after.generation == before.generation
    assert [r.pid for r in after.ranks] == [r.pid for r in before.ranks]
    assert all(psutil.pid_exists(r.pid) for r in after.ranks if r.pid)


def test_a_tool_call_on_an_instance(pair: Pair, tmp_path: Path) -> None:
    """The tool model (tests/support/toolmodel.py) split over a and b: its call comes out of
    its text as on any runner, in the job and in the OpenAI answer."""
    model = create_tool_model(tmp_path / "tools")
    instance_id = place(pair.api, model)
    wait_until(
        lambda: (r := pair.store.instances.get(instance_id)) and r.status == "Ready",
        START_TIMEOUT_S,
        "the tool model's instance Ready",
        0.5,
    )
    spec = {"type": "function", "function": {"name": CALL["name"], "parameters": {}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        with client_for(pair.api) as client:
            answer = client.chat.completions.create(model="tools", messages=ask, tools=[spec])  # type: ignore[arg-type,list-item]
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls or []
        assert (call.function.name, call.function.arguments) == (CALL["name"], '{"city": "Paris"}')  # type: ignore[union-attr]
    finally:
        pair.api.post(f"/v1/instances/{instance_id}/shutdown", json={"mode": "hard"})
        wait_until(
            lambda: (r := pair.store.instances.get(instance_id)) and r.status == "Shutdown",
            30,
            "the tool model's instance stopped",
        )
