"""HTTP parts of the serving app that know nothing of models: relay's JSON error shape and the
request-body limit."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError


class ErrorItem(BaseModel):
    loc: str
    msg: str
    type: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx relay answers (for the OpenAPI document; `error` builds them)."""

    error: str
    detail: list[ErrorItem] | None = None


def error(status: int, message: str, detail: list[dict[str, Any]] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status)


def error_detail(exc: ValidationError, prefix: tuple = ()) -> list[dict[str, Any]]:
    """pydantic errors as JSON-safe dicts with a dotted path; the offending input is left out
    (it can be a megabyte of pixels)."""
    return [
        {
            "loc": ".".join(str(part) for part in (*prefix, *item["loc"])),
            "msg": item["msg"],
            "type": item["type"],
        }
        for item in exc.errors(include_url=False)
    ]


# How much of a body over the limit is read (and dropped) before the 413 goes out; see
# BodyLimit.too_large. Loopback reads this much in well under a second.
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


def ambiguous_framing(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's body length is ambiguous, or None: two Content-Lengths, or one beside
    Transfer-Encoding. A proxy in front and this server could each take a different one for
    the body's end, and read the rest as another request (request smuggling); whatever the
    front end (HAProxy, Serve's proxy, a load balancer of the operator's), refused here."""
    names = [name.lower() for name, _ in headers]
    lengths = names.count(b"content-length")
    if lengths > 1:
        return f"{lengths} Content-Length headers: the body's length is ambiguous"
    if lengths and b"transfer-encoding" in names:
        return "Content-Length beside Transfer-Encoding: the body's length is ambiguous"
    return None


class BodyLimit:
    """Pure ASGI middleware: read the whole request body before anything parses it, answering
    413 once it exceeds `max_bytes` — by Content-Length when there is one, else by counting
    chunks as they arrive (chunked transfer has no length to check up front).

    The 413 must reach the client. Most clients (requests, curl without `Expect`) read the
    answer only after sending their whole body, and a server that answers and closes while
    the body is still coming makes the client's kernel see a reset instead (a 25 MB body did).
    So the rest of an oversized body is read and dropped first — never kept, at most
    DRAIN_LIMIT_BYTES of it; beyond that the connection is cut. A client that sent
    `Expect: 100-continue` has not sent its body yet: it gets the 413 at once, and sends none.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if problem := ambiguous_framing(scope["headers"]):
            refusal = error(400, problem)
            # Where this body ends is unknown, so is where a next request would start.
            refusal.headers["connection"] = "close"
            return await refusal(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error(400, "invalid Content-Length")(scope, receive, send)
            if int(length) > self.max_bytes:
                # Not sent yet (`Expect: 100-continue`), or more than is worth reading.
                waiting = headers.get(b"expect", b"").lower() == b"100-continue"
                drain = not waiting and int(length) <= DRAIN_LIMIT_BYTES
                return await self.too_large(scope, receive, send, drain=drain)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self.too_large(scope, receive, send, drain=more, read=size)
            if not more:
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send, drain: bool, read: int = 0) -> None:
        while drain and read <= DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away: nobody to answer
            read += len(message.get("body", b""))
            drain = message.get("more_body", False)
        await error(413, f"request body exceeds {self.max_bytes} bytes")(scope, receive, send)
