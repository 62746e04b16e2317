"""The FastAPI app each replica serves (relay/serving/app.py documents the routes): the routes
by protocol, the OpenAPI document with each served model's schemas, and the ASGI layer that puts
`x-model-version` on every answer about a model and counts it."""

import logging
import re
import time
import uuid
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.serving import open_inference as v2
from relay.serving.answers import shown_version
from relay.serving.args import ReplicaArgs
from relay.serving.metrics import ReplicaMetrics
from relay.serving.model_table import LoadedModel
from relay.serving.web import BodyLimit, ErrorBody, error
from relay.version import __version__

logger = logging.getLogger(__name__)
# On every response about a model: the version that answered (the registry's number, or the
# reference when the model was served from a run id or a checkpoint directory).
VERSION_HEADER = "x-model-version"
PLATFORM = "relay_pytorch"  # the v2 metadata's "platform": <framework>_<backend>-like


class Replica(Protocol):
    """What the routes and ModelResponses use of a replica: relay/serving/app.py's ModelServer,
    described here rather than imported (app.py imports this module)."""

    args: ReplicaArgs
    table: dict[str, LoadedModel]
    metrics: ReplicaMetrics

    def entry(self, name: str) -> LoadedModel | None: ...
    def unknown(self, name: str) -> JSONResponse: ...
    def metadata(self, entry: LoadedModel) -> dict[str, Any]: ...
    def stats(self, entry: LoadedModel) -> dict[str, Any]: ...
    async def predict(self, entry: LoadedModel, body: bytes) -> JSONResponse: ...
    async def infer(self, entry: LoadedModel, body: bytes) -> JSONResponse: ...
    async def scrape(self) -> bytes: ...


# The model a path is about: /v1/models/{name}..., /v2/models/{name}...
MODEL_PATH = re.compile(r"^/v[12]/models/([^/:]+)")


def model_named_in(scope) -> str | None:
    """The model name in a request's path, below the application's route prefix (ASGI's
    `path` includes `root_path`)."""
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    match = MODEL_PATH.match(path)
    return match.group(1) if match else None


class ModelResponses:
    """Pure ASGI middleware, outside the body limit: for each request about a model, the path
    parsed once to
    - put `x-model-version` on a response that lacks it (routes set it themselves, from the
      version they ran; this covers answers that come before a route, e.g. a 413 for a body over
      the limit; with one model served, every response is about it);
    - time it and count its status in the replica's metrics, under the version that answered —
      for served names only, so a client cannot make up label values."""

    def __init__(self, app, server: Replica) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        table = self.server.table
        name = model_named_in(scope)
        entry = table.get(name) if name else None
        if entry is None and len(table) == 1:
            entry = next(iter(table.values()))
        if entry is None:
            return await self.app(scope, receive, send)
        counted = name in table  # not /healthz, /docs, or an unknown name
        default = (VERSION_HEADER.encode(), shown_version(entry).encode())
        start, status, version = time.perf_counter(), 500, shown_version(entry)
        started = False

        async def noting(message) -> None:
            nonlocal status, version, started
            if message["type"] == "http.response.start":
                started = True
                status, headers = message["status"], message.get("headers", [])
                given = next((v for k, v in headers if k == default[0]), None)
                if given is None:
                    message = {**message, "headers": [*headers, default]}
                else:
                    version = given.decode()
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except Exception as exc:
            if started:
                raise
            # Answered here: FastAPI's handler for Exception runs outside every middleware
            # (Starlette's ServerErrorMiddleware), where this one could not add the version.
            await internal_error(exc, scope["path"])(scope, receive, noting)
        finally:
            if counted:
                self.server.metrics.request(name, version, status, time.perf_counter() - start)


def internal_error(exc: Exception, path: str) -> JSONResponse:
    """A 500 that tells the client nothing of the server (an exception's text can hold paths,
    parts of the model, of other requests): a generic message and an id, under which the
    replica's log has the whole traceback."""
    incident = uuid.uuid4().hex[:16]
    logger.error("internal error %s answering %s", incident, path, exc_info=exc)
    return error(500, f"internal error (id {incident}; the server's log has the details)")


def answered_by(entry: LoadedModel, response: JSONResponse) -> JSONResponse:
    response.headers[VERSION_HEADER] = shown_version(entry)
    return response


def build_http_app(server: Replica) -> FastAPI:
    # FastAPI's own /docs page loads Swagger UI from a CDN: blank on a machine without internet
    # access. fastapi-offline's serves the same page from files in the package
    # (/static-offline-docs); ReDoc, CDN-only in FastAPI too, is left out.
    api = FastAPIOffline(
        title="relay",
        version=__version__,
        description="Models served by relay: KServe v1 and v2 (Open Inference) protocols.",
        redoc_url=None,
    )
    api.add_middleware(BodyLimit, max_bytes=server.args.max_body_bytes)
    # Added after the body limit, so outside it: its 413s carry the version and are counted.
    api.add_middleware(ModelResponses, server=server)
    api.openapi = lambda: openapi(api, server)
    # In this order: the routes' order is the OpenAPI document's.
    add_error_handlers(api)
    add_health_routes(api, server)
    add_model_listing_routes(api, server)
    add_v1_predict_route(api, server)
    add_v2_routes(api, server)
    return api


def add_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @api.exception_handler(Exception)  # requests about a model: ModelResponses answers
    async def unhandled(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, request.url.path)


def add_health_routes(api: FastAPI, server: Replica) -> None:
    """/healthz and /metrics."""

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        return Response(await server.scrape(), media_type=CONTENT_TYPE_LATEST)


def add_model_listing_routes(api: FastAPI, server: Replica) -> None:
    """KServe v1: the models served, each one's metadata and batch statistics."""

    @api.get("/v1/models")
    async def list_models() -> JSONResponse:
        table = server.table
        return JSONResponse({"models": [server.metadata(table[name]) for name in sorted(table)]})

    @api.get("/v1/models/{name}")
    async def model_metadata(name: str) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        return answered_by(entry, JSONResponse(server.metadata(entry)))

    @api.get("/v1/models/{name}/stats")
    async def model_stats(name: str) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        return answered_by(entry, JSONResponse(server.stats(entry)))


def add_v1_predict_route(api: FastAPI, server: Replica) -> None:
    """KServe / TF-Serving v1: POST /v1/models/{name}:predict."""

    # Documented per served model by openapi() below, with that model's schemas.
    @api.post("/v1/models/{name}:predict", include_in_schema=False)
    async def predict(name: str, request: Request) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        # The body is parsed here, not by FastAPI, so every failure gets relay's error shape
        # and the task can check what depends on the model (validation context).
        return answered_by(entry, await server.predict(entry, await request.body()))


def add_v2_routes(api: FastAPI, server: Replica) -> None:
    """KServe v2 (the Open Inference Protocol): server, health, model metadata, infer."""

    @api.get("/v2")
    async def v2_server() -> dict[str, Any]:
        return {"name": "relay", "version": __version__, "extensions": []}

    @api.get("/v2/health/live")
    async def v2_live() -> dict[str, bool]:
        return {"live": True}

    @api.get("/v2/health/ready", responses={503: {"description": "no model loaded yet"}})
    async def v2_ready() -> JSONResponse:
        ready = bool(server.table)
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @api.get("/v2/models/{name}")
    async def v2_model_metadata(name: str) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        body = v2.model_metadata(
            name,
            [shown_version(entry)],
            PLATFORM,
            entry.task.instance_schema(),
            entry.task.Prediction,
        )
        return answered_by(entry, JSONResponse(body))

    @api.get("/v2/models/{name}/ready")
    async def v2_model_ready(name: str) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        return answered_by(entry, JSONResponse({"name": name, "ready": True}))

    @api.post("/v2/models/{name}/infer", include_in_schema=False)
    async def v2_infer(name: str, request: Request) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        return answered_by(entry, await server.infer(entry, await request.body()))


def openapi(api: FastAPI, server: Replica) -> dict[str, Any]:
    """The OpenAPI document: the fixed routes, and for each served model its own predict path
    with its task's request and response schemas. Built per call: a swap can change them."""
    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    paths, components = schema["paths"], schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    limits = Field(min_length=1, max_length=server.args.max_instances)
    closed = ConfigDict(extra="forbid")  # predict() refuses unknown fields: say so
    refusals = {"4XX": {"description": "refused: relay's error shape", **_json_ref(ErrorBody)}}
    not_served = {"description": "no model of that name is served", **_json_ref(ErrorBody)}
    for path, operations in paths.items():
        if "{name}" in path:  # any string is a name: FastAPI's own 422 never comes
            for operation in operations.values():
                operation["responses"].pop("422", None)
                operation["responses"]["404"] = not_served
    for name, entry in sorted(server.table.items()):
        prefix = re.sub(r"\W", "_", name)
        request_model = create_model(
            f"{prefix}_PredictRequest",
            __config__=closed,
            instances=(list[entry.task.instance_schema().request_item()], limits),
        )
        response_model = create_model(
            f"{prefix}_PredictResponse", predictions=(list[entry.task.Prediction], ...)
        )
        infer_model = v2.infer_request_model(
            prefix, entry.task.instance_schema(), entry.task.Prediction
        )
        about = f"{name} (version {shown_version(entry)}, task {entry.info.task})"
        paths[f"/v1/models/{name}:predict"] = {
            "post": {
                "summary": f"Predict with {about}",
                "operationId": f"predict_{prefix}",
                "requestBody": {"required": True, **_json_ref(request_model)},
                "responses": {
                    "200": {"description": "Predictions", **_json_ref(response_model)},
                    **refusals,
                },
            }
        }
        paths[f"/v2/models/{name}/infer"] = {
            "post": {
                "summary": f"Infer with {about}: the tensors GET /v2/models/{name} names",
                "operationId": f"infer_{prefix}",
                "requestBody": {"required": True, **_json_ref(infer_model)},
                "responses": {
                    "200": {"description": "Outputs", **_json_ref(v2.InferResponse)},
                    **refusals,
                },
            }
        }
        for model in (request_model, response_model, infer_model):
            add_schema(schemas, model)
    for model in (v2.InferResponse, ErrorBody):
        add_schema(schemas, model)
    return schema


def add_schema(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    """`model` (and the models it nests) into the OpenAPI components."""
    spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(spec.pop("$defs", {}))
    schemas[model.__name__] = spec


def _json_ref(model: type[BaseModel]) -> dict[str, Any]:
    ref = f"#/components/schemas/{model.__name__}"
    return {"content": {"application/json": {"schema": {"$ref": ref}}}}
