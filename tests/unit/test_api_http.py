"""http.sse_response: what a stream counted is released once, however often the server closes
its response."""

from __future__ import annotations

from flask import Flask, Response

from exo_tasks.api.http import sse_response
from exo_tasks.api.streams import StreamCap


def test_a_streams_release_runs_once_however_often_its_response_is_closed() -> None:
    cap = StreamCap(limit=1)
    app = Flask(__name__)

    @app.get("/stream")
    def stream() -> Response:
        return sse_response(iter(["data: 1\n\n"]), on_close=cap.acquire())

    client = app.test_client()
    response = client.get("/stream")
    assert response.get_data(as_text=True) == "data: 1\n\n"
    response.close()
    response.close()
    assert cap.open == 0
    second = client.get("/stream")  # the one stream allowed is free again
    assert second.status_code == 200
    second.close()
    assert cap.open == 0
