"""relay's outermost ASGI layer of a replica (relay/serving/routes.py, ModelResponses), called as
Serve calls it: every answer about a model carries the version that answered, a crash's 500
too, and is counted in the replica's metrics under that version."""

from __future__ import annotations

import asyncio
import json

import pytest

from relay.serving import metrics
from relay.serving.model_table import LoadedModel, ModelInfo
from relay.serving.routes import VERSION_HEADER, ModelResponses

pytestmark = pytest.mark.timeout(30)


class Replica:
    """What ModelResponses reads of a replica: its model table and its metrics."""

    def __init__(self) -> None:
        info = ModelInfo(
            name="digits", reference="digits:3", version=3, task="digits", checkpoint="/unused"
        )
        self.table = {"digits": LoadedModel(info, task=None, model=None)}
        self.metrics = metrics.ReplicaMetrics()


def call(app, path: str) -> list[dict]:
    """One POST through `app`; the ASGI messages it sent."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_crash_in_a_model_route_is_a_json_500_with_the_version():
    async def crashing_route(scope, receive, send) -> None:
        raise RuntimeError("the forward pass fell over")

    replica = Replica()
    start, body = call(ModelResponses(crashing_route, replica), "/v1/models/digits:predict")
    assert start["status"] == 500
    assert (VERSION_HEADER.encode(), b"3") in start["headers"]
    answer = json.loads(body["body"])
    # Generic, with an id for the log (tests/test_http_hardening.py): not the exception's text.
    assert answer["error"].startswith("internal error (id ") and "fell over" not in answer["error"]
    assert dict(replica.metrics.requests) == {("digits", "3", "500"): 1}


def test_a_crash_after_the_answer_began_is_not_answered_twice():
    async def half_answering_route(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("mid-body")

    replica = Replica()
    with pytest.raises(RuntimeError, match="mid-body"):
        call(ModelResponses(half_answering_route, replica), "/v1/models/digits:predict")
    assert dict(replica.metrics.requests) == {("digits", "3", "200"): 1}
