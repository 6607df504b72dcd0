"""How each line of a batch ends, as a line of its output or error file: the answer its
endpoint gives the same request directly, rendered by the OpenAI routes' own renderers
(exo_tasks.openai_render) and errors (exo_tasks.errors.render), never a copy of them; or why
the request never ran to its end."""

from __future__ import annotations

from typing import Any

from exo_tasks import errors
from exo_tasks.batch.jobs import line_job_id
from exo_tasks.batch_types import (
    Batch,
    BatchStatus,
    FileObject,
    LineError,
    LineResponse,
    ResultLine,
)
from exo_tasks.openai_render import ChatRenderer, Renderer, TextRenderer, failure
from exo_tasks.openai_types import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from exo_tasks.types import JobRecord, JobStatus

# Each endpoint's request model and renderer, as its route uses them.
ENDPOINTS: dict[str, tuple[type[OpenAIRequest], Renderer]] = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatRenderer()),
    "/v1/completions": (CompletionRequest, TextRenderer()),
}
# Why a request that was cut short by its batch never answered.
CUT_SHORT = {
    BatchStatus.CANCELLING: (
        "batch_cancelled",
        "the batch was cancelled before this request finished",
    ),
    BatchStatus.EXPIRED: (
        "batch_expired",
        "this request could not be executed before the completion window expired",
    ),
}


class LineResults:
    """Renders result lines."""

    def refused(self, batch: Batch, line: int, custom_id: str, exc: Exception) -> ResultLine:
        """A request its endpoint refuses (a body it rejects, a model no host serves)."""
        # Every batch endpoint is an OpenAI route: its errors answer in OpenAI's shape.
        status, body, _ = errors.render(exc, openai=True)
        return self._answered(batch, line, custom_id, status, body)

    def of_job(
        self, batch: Batch, line: int, custom_id: str, job: JobRecord, cut: BatchStatus | None
    ) -> ResultLine:
        """The line of an ended job; `cut`: the batch's status if it ended the job (a cancel,
        the window's end)."""
        if job.status == JobStatus.SUCCEEDED:
            _, renderer = ENDPOINTS[batch.endpoint]
            body = renderer.whole(job).model_dump(mode="json")
            return self._answered(batch, line, custom_id, 200, body)
        if job.status == JobStatus.FAILED:
            return self.refused(batch, line, custom_id, failure(job))
        if job.status == JobStatus.CANCELLED and cut in CUT_SHORT:
            return self.never_ran(batch, line, custom_id, cut)
        code = "request_timeout" if job.status == JobStatus.TIMED_OUT else "request_cancelled"
        message = job.error or f"the request's job ended {job.status}"
        return _unanswered(batch, line, custom_id, code, message)

    def never_ran(self, batch: Batch, line: int, custom_id: str, cut: BatchStatus) -> ResultLine:
        return _unanswered(batch, line, custom_id, *CUT_SHORT[cut])

    @staticmethod
    def _answered(
        batch: Batch, line: int, custom_id: str, status: int, body: dict[str, Any]
    ) -> ResultLine:
        response = LineResponse(
            status_code=status, request_id=line_job_id(batch.id, line), body=body
        )
        return ResultLine(id=_line_id(batch, line), custom_id=custom_id, response=response)


def succeeded(result: ResultLine) -> bool:
    """A line for the output file (else the error file)."""
    return result.response is not None and result.response.status_code == 200


def _unanswered(batch: Batch, line: int, custom_id: str, code: str, message: str) -> ResultLine:
    error = LineError(code=code, message=message)
    return ResultLine(id=_line_id(batch, line), custom_id=custom_id, error=error)


def _line_id(batch: Batch, line: int) -> str:
    return f"batch_req_{batch.id.removeprefix('batch_')}_{line}"


def result_file(batch: Batch, kind: str, lines: list[str], now: int) -> tuple[FileObject, str]:
    """The batch's `output` or `error` file of `lines`: its object and content. Its id follows
    from the batch's, so a feeder that ends the batch again writes the same file."""
    content = "".join(line + "\n" for line in lines)
    meta = FileObject(
        id=f"file-{batch.id.removeprefix('batch_')}-{kind}",
        bytes=len(content.encode()),
        created_at=now,
        filename=f"{batch.id}_{kind}.jsonl",
        purpose="batch_output",
    )
    return meta, content
