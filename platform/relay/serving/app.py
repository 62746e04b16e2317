"""The Serve application: registered models behind one FastAPI ingress, batched forwards.

`relay serve digits:best [charlm:best ...]` runs it (relay/serving/command.py), `serve run
serve.app:app model=digits:best` too (serve/app.py re-exports `app`), and `serve deploy
serve/config.yaml` on a running cluster. Any field of `AppArgs` can follow `serve run` as
key=value. Every replica holds every model of the endpoint (relay/serving/model_table.py: the
table, and how `relay deploy` swaps a version in without a failed request).

Protocols: KServe / TF-Serving v1 REST, and KServe v2 (the Open Inference Protocol,
relay/serving/open_inference.py):

    POST /v1/models/{name}:predict   {"instances": [...]} → {"predictions": [...]}
    GET  /v1/models                  {"models": [the metadata of each]}
    GET  /v1/models/{name}           {"name", "ready", "version", "task", ...}
    GET  /v1/models/{name}/stats     batch sizes this replica has run (a histogram)
    POST /v2/models/{name}/infer     named tensors in, named tensors out
    GET  /v2/models/{name}           the tensors' names, datatypes and shapes
    GET  /v2/health/live, /v2/health/ready, /v2/models/{name}/ready, /healthz
    GET  /metrics                    Prometheus: requests, latency, batch sizes per model
    GET  /docs                       OpenAPI (Swagger UI, served offline), each model's schema

Every response about a model carries `x-model-version`: the version that answered.

`{name}` is the registry model name ("digits" for `digits:best`). What one instance and one
prediction look like is the task's business (`Task.Instance` / `Task.Prediction`, e.g. digits:
64 pixels 0–16 → {"label", "probabilities"}). Every bad request gets a 4xx JSON body
`{"error": ..., "detail": [{"loc": "instances.0.pixels.3", "msg": ..., "type": ...}]}` and
never reaches the model: malformed JSON 400, unknown model 404, a body over `max_body_bytes`
(counted as it arrives, so chunked bodies too), more objects and arrays than `max_instances`
instances need (counted before parsing: relay/serving/json_limits.py) or more than
`max_instances` instances 413, JSON nested deeper than 32 levels 422, an ambiguous body length
(two Content-Lengths, or one beside chunked) 400, any
instance the task's schema rejects (wrong type or shape, missing or unknown field, NaN/inf, out
of range) 422 naming its index. Valid instances from concurrent requests are run together:
one forward serves many callers, and a caller alone is not held back for company
(relay/serving/batching.py; `batching: serve` uses Ray Serve's `@serve.batch` instead). A 500
says only "internal error" and an id; the replica's log has the details under that id. No
answer shows where a checkpoint lies: a model served from its directory is shown by the last
two parts of its path. Past `max_ongoing_requests` in flight and `max_queued_requests` waiting,
a replica answers 503 (Serve's backpressure).

Which ingress carries the requests to the replicas (HAProxy or Serve's Python proxy) is
relay/serving/ingress.py's business; the application is the same for both.
"""

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import yaml
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from ray import serve
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.config import NAME_PATTERN
from relay.runtime import ray_private
from relay.serving import json_limits, metrics, model_table, staging
from relay.serving import open_inference as v2
from relay.serving.batching import AdaptiveBatcher
from relay.serving.model_table import LoadedModel, ModelInfo
from relay.serving.web import BodyLimit, ErrorBody, error, error_detail
from relay.version import __version__

logger = logging.getLogger(__name__)
MIB = 1 << 20
# On every response about a model: the version that answered (the registry's number, or the
# reference when the model was served from a run id or a checkpoint directory).
VERSION_HEADER = "x-model-version"
DEPLOYMENT = "relay-models"
PLATFORM = "relay_pytorch"  # the v2 metadata's "platform": <framework>_<backend>-like


class ReplicaArgs(BaseModel):
    """What each replica is built from (its constructor's arguments). The rest of `AppArgs`
    either travels in the user_config (which models) or is Serve's own deployment config
    (replica counts, in-flight limit, access log), which Serve changes without a restart."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.5, gt=0, description="CPUs each replica reserves.")
    max_batch_size: int = Field(32, ge=1, description="Instances per forward pass (1: none).")
    batching: Literal["adaptive", "serve"] = Field(
        "adaptive",
        description="adaptive: a request alone never waits for a batch to fill, overlapping "
        "ones do (relay/serving/batching.py); serve: Ray Serve's @serve.batch, every batch "
        "waits.",
    )
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="How long a forward may wait for its batch to fill."
    )
    max_instances: int = Field(256, ge=1, description="Instances one request may carry.")
    max_body_bytes: int = Field(MIB, ge=1, description="Largest request body, in bytes.")


class AppArgs(ReplicaArgs):
    """What `serve run serve.app:app key=value ...` and serve/config.yaml's `args` accept.

    Values arrive as strings from the command line; pydantic converts them ("0.5" → 0.5).
    """

    model: list[str] = Field(
        min_length=1,
        description="Registry references (name:best, name:latest, name:N, a run id, or a "
        "checkpoint directory), one per model; a string may list several, comma-separated.",
    )
    storage: str | None = Field(None, description="Storage root; null: $RELAY_HOME, ~/relay.")
    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,  # as registry names: one URL path segment
        description="Model name in URLs, when one model is served; null: the registry model "
        "name (or the task's).",
    )
    replicas: int = Field(1, ge=1, description="Replicas (the minimum when autoscaling).")
    max_replicas: int | None = Field(
        None, ge=1, description="Autoscale up to this many replicas; null: a fixed count."
    )
    target_ongoing_requests: float = Field(
        32, gt=0, description="Autoscaling target of in-flight requests per replica."
    )
    # Serve's default (5) queues requests at the proxy long before a replica is busy; at 256 a
    # replica holds enough requests in flight to fill its batches (RAY-NOTES, 32 clients: 20 →
    # 283 req/s together with the access log off).
    max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests per replica.")
    # Serve's default (-1) lets requests beyond max_ongoing_requests wait without bound, each
    # holding its connection and body; past this many waiting, a replica answers 503 at once.
    max_queued_requests: int = Field(
        1024, ge=1, description="Requests waiting for a replica's in-flight slot; then 503."
    )
    access_log: bool = Field(False, description="Log every request (a log line costs time).")
    replica_resources: dict[str, float] | None = Field(
        None,
        description="Custom Ray resources each replica asks for besides its CPUs, e.g. "
        "{host1: 1} to place replicas on the nodes that offer `host1` (`ray start "
        "--resources`); a string is read as YAML.",
    )

    @field_validator("replica_resources", mode="before")
    @classmethod
    def _resources_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the command line or `serve run key=value`
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError as exc:
                raise ValueError(f"not YAML: {value!r} ({exc.problem})") from None
        return value

    @field_validator("replica_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (value or {}).items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"{name} is one of Ray's own resources, not a custom one "
                    "(a replica's CPUs: num_cpus)"
                )
            if amount <= 0:
                raise ValueError(f"{name}: {amount} is not a positive amount")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _one_name(self) -> "AppArgs":
        if self.name is not None and len(self.model) > 1:
            raise ValueError("name renames one model; it cannot name several")
        return self

    def replica_args(self) -> ReplicaArgs:
        return ReplicaArgs.model_validate(self.model_dump(include=set(ReplicaArgs.model_fields)))


def resolve_models(args: AppArgs, allow_task: Iterable[str] = ()) -> list[ModelInfo]:
    """Each reference → its checkpoint. Raises KeyError (no such model), TypeError (its task
    cannot be served), OSError (the checkpoint is unreadable) or ValueError (two models with
    one name; a checkpoint naming a task neither built in nor in `allow_task`: see
    model_table.resolve)."""
    models = [model_table.resolve(ref, args.storage, args.name, allow_task) for ref in args.model]
    names = [info.name for info in models]
    if len(set(names)) < len(names):
        raise ValueError(f"two models named {max(names, key=names.count)!r} on one endpoint")
    return models


# --- the deployment --------------------------------------------------------------------------


@serve.deployment
@serve.ingress()  # the FastAPI app is built per replica
class ModelServer:
    def __init__(self, args: ReplicaArgs) -> None:
        import torch

        # Threads beyond the reserved CPUs only fight the other replicas (and Ray) for cores.
        torch.set_num_threads(max(1, int(args.num_cpus)))
        self.args = args
        self.table: dict[str, LoadedModel] = {}  # filled by reconfigure, before any request
        # Loaded ahead of the next reconfigure, for the table relay deploy staged.
        self.staged: dict[str, LoadedModel] = {}
        # One forward at a time, off the event loop: a long generate() must not stall health
        # checks or the intake of the next batch.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.started = time.time()
        self.metrics = metrics.ReplicaMetrics()
        # Started by the first reconfigure (an event loop runs by then).
        self.background: list[asyncio.Task] = []
        self.forward_serve_batched.set_max_batch_size(args.max_batch_size)
        self.forward_serve_batched.set_batch_wait_timeout_s(args.batch_wait_timeout_s)

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this with the user_config: at start, and on `relay deploy`. Requests go
        on meanwhile; the new table replaces the old one in one assignment. What relay deploy
        staged is loaded already (relay/serving/staging.py)."""
        models = model_table.models_of(config)
        table = await model_table.load_table(models, self.table, self.staged)
        self.staged = {}
        for entry in table.values():
            if entry.batcher is None:
                entry.batcher = AdaptiveBatcher(
                    lambda instances, entry=entry: self.forward(entry, instances),
                    self.args.max_batch_size,
                    self.args.batch_wait_timeout_s,
                )
        self.table = table
        if not self.background:
            context = serve.get_replica_context()
            replica, app_name = context.replica_id.unique_id, context.app_name
            self.background = [
                asyncio.create_task(metrics.push_forever(self.metrics, replica, app_name)),
                asyncio.create_task(staging.watch_forever(app_name, replica, self.stage)),
            ]

    async def stage(self, config: dict[str, Any] | None) -> None:
        """Load the models of a staged table beside the served ones, for the reconfigure that
        follows (None: the staging was called off; drop them)."""
        if config is None:
            self.staged = {}
            return
        staged = await model_table.load_table(
            model_table.models_of(config), self.table, self.staged
        )
        served = {id(entry) for entry in self.table.values()}
        for entry in staged.values():
            entry.staged = entry.staged or id(entry) not in served
        self.staged = staged

    async def forward(self, entry: LoadedModel, instances: list[BaseModel]) -> list[dict]:
        """One forward pass of one model over a batch of validated instances."""
        entry.batch_sizes[len(instances)] += 1
        self.metrics.batch(entry.info.name, shown_version(entry), len(instances))
        loop = asyncio.get_running_loop()
        predictions = await loop.run_in_executor(
            self.executor, entry.task.predict, entry.model, instances
        )
        return [prediction.model_dump(mode="json") for prediction in predictions]

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)  # reset per app in __init__
    async def forward_serve_batched(
        self, items: list[tuple[LoadedModel, BaseModel]]
    ) -> list[dict[str, Any]]:
        # One batch may mix models (and versions, across a swap): one forward per model.
        results: list[Any] = [None] * len(items)
        for entry in {id(entry): entry for entry, _ in items}.values():
            indices = [i for i, (e, _) in enumerate(items) if e is entry]
            predictions = await self.forward(entry, [items[i][1] for i in indices])
            for i, prediction in zip(indices, predictions, strict=True):
                results[i] = prediction
        return results

    async def run(self, entry: LoadedModel, instances: list[BaseModel]) -> list[dict]:
        if self.args.batching == "adaptive":
            return await entry.batcher.submit(instances)
        return list(
            await asyncio.gather(*(self.forward_serve_batched((entry, i)) for i in instances))
        )

    def entry(self, name: str) -> LoadedModel | None:
        return self.table.get(name)

    def unknown(self, name: str) -> JSONResponse:
        served = ", ".join(repr(n) for n in sorted(self.table)) or "none"
        return error(404, f"unknown model {name!r}; this server has {served}")

    def metadata(self, entry: LoadedModel) -> dict[str, Any]:
        info = entry.info  # not its checkpoint: where files lie is no client's business
        return {
            "name": info.name,
            "reference": shown(info.reference),
            "version": shown(info.version),
            "task": info.task,
            "ready": True,
            "max_batch_size": self.args.max_batch_size,
            "max_instances": self.args.max_instances,
        }

    def stats(self, entry: LoadedModel) -> dict[str, Any]:
        sizes = entry.batch_sizes
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "version": shown(entry.info.version),
            "loaded_before_swap": entry.staged,
            "batches": sum(sizes.values()),
            "instances": sum(size * n for size, n in sizes.items()),
            "max_batch_size_seen": max(sizes, default=0),
            "batch_size_histogram": {str(k): v for k, v in sorted(sizes.items())},
            "uptime_s": round(time.time() - self.started, 3),
        }

    async def predict(self, entry: LoadedModel, body: bytes) -> JSONResponse:
        payload, malformed = parse_json(body, self.args.max_instances)
        if malformed:
            return malformed
        if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
            detail = [{"loc": "instances", "msg": "expected a list", "type": "list_type"}]
            return error(422, 'the body must be {"instances": [...]}', detail)
        if extra := sorted(set(payload) - {"instances"}):
            detail = [{"loc": k, "msg": "unknown field", "type": "extra_forbidden"} for k in extra]
            return error(422, "unknown fields in the body", detail)
        raw = payload["instances"]
        if not raw:
            detail = [{"loc": "instances", "msg": "no instances", "type": "too_short"}]
            return error(422, "no instances", detail)
        if len(raw) > self.args.max_instances:
            message = f"{len(raw)} instances; at most {self.args.max_instances} per request"
            return error(413, message, [{"loc": "instances", "msg": message, "type": "too_long"}])
        try:
            instances = entry.task.validate_instances(raw)
        except ValidationError as exc:
            return error(422, "invalid instances", error_detail(exc, ("instances",)))
        predictions = await self.run(entry, instances)
        return json_or_non_finite({"predictions": predictions}, predictions, "instances")

    async def infer(self, entry: LoadedModel, body: bytes) -> JSONResponse:
        """KServe v2: named tensors → the task's instances → the same forwards as v1."""
        payload, malformed = parse_json(body, self.args.max_instances)
        if malformed:
            return malformed
        schemas = entry.task.Instance, entry.task.Prediction
        try:
            rows = v2.instances_from_infer_request(payload, schemas[0], self.args.max_instances)
            outputs = v2.requested_outputs(payload, schemas[1])
            try:
                instances = entry.task.validate_instances(rows)
            except ValidationError as exc:
                raise v2.validation_error(exc, schemas[0]) from None
        except v2.InferError as exc:
            return error(exc.status, exc.message, exc.detail)
        predictions = await self.run(entry, instances)
        body = v2.infer_response(
            entry.info.name,
            shown_version(entry),
            payload.get("id"),
            predictions,
            schemas[1],
            outputs,
        )
        return json_or_non_finite(body, predictions, "inputs.*")

    async def scrape(self) -> bytes:
        """/metrics: this replica's counts, live, and every other replica's last push."""
        context = serve.get_replica_context()
        others = await metrics.board(context.app_name).collect.remote()
        others.pop(context.replica_id.unique_id, None)
        return metrics.render([self.metrics.snapshot(), *others.values()])

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self)


def shown(value: int | str) -> int | str:
    """A model's reference or version as clients see it: a model served from a checkpoint
    directory has its absolute path as both, and a client learns only the last two parts
    (the run and the checkpoint, e.g. `digits-a1b2/epoch_0003`), not the server's layout."""
    if isinstance(value, str) and os.path.isabs(value):
        return "/".join(Path(value).parts[-2:])
    return value


def shown_version(entry: LoadedModel) -> str:
    """What `x-model-version`, the metrics and the v2 API call `entry`'s version."""
    return str(shown(entry.info.version))


def parse_json(body: bytes, max_instances: int) -> tuple[Any, JSONResponse | None]:
    """The body as JSON, or the 4xx to answer. The routes parse bodies themselves, not
    FastAPI, so that every failure gets relay's error shape. Its structure is bounded before
    it is parsed (relay/serving/json_limits.py): objects and arrays by what `max_instances`
    instances need (413), their nesting (422)."""
    try:
        json_limits.check(body, json_limits.body_budget(max_instances))
    except json_limits.TooMuchJSON as exc:
        detail = [{"loc": "body", "msg": str(exc), "type": exc.kind}]
        return None, error(exc.status, f"refused: {exc}", detail)
    try:
        return json.loads(body), None
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a 5000-digit number
        return None, error(400, f"malformed JSON: {exc}")


def json_or_non_finite(body: Any, predictions: list[Any], loc: str) -> JSONResponse:
    """`body` as JSON — or, when a prediction holds an infinite or NaN number, which JSON cannot
    encode, a 422 naming its instance (`loc`.index). A valid input far outside what the model
    was trained on (a feature of 1e38 in a float32 model) can overflow; encoding it would fail
    as a 500. Looked for only when encoding fails: the usual answer pays nothing."""
    try:
        return JSONResponse(body)
    except ValueError:  # "Out of range float values are not JSON compliant"
        row = next((i for i, p in enumerate(predictions) if not _finite(p)), None)
        if row is None:  # some other failure: the 500 it is
            raise
    message = "the model's output for this input is not finite (an input far out of range?)"
    detail = [{"loc": f"{loc}.{row}", "msg": message, "type": "non_finite_output"}]
    return error(422, message, detail)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


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

    def __init__(self, app, server: ModelServer) -> None:
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


def build_http_app(server: ModelServer) -> FastAPI:
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

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @api.exception_handler(Exception)  # requests about a model: ModelResponses answers
    async def unhandled(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, request.url.path)

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        return Response(await server.scrape(), media_type=CONTENT_TYPE_LATEST)

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

    # Documented per served model by openapi() below, with that model's schemas.
    @api.post("/v1/models/{name}:predict", include_in_schema=False)
    async def predict(name: str, request: Request) -> JSONResponse:
        if (entry := server.entry(name)) is None:
            return server.unknown(name)
        # The body is parsed here, not by FastAPI, so every failure gets relay's error shape
        # and the task can check what depends on the model (validation context).
        return answered_by(entry, await server.predict(entry, await request.body()))

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

    return api


def openapi(api: FastAPI, server: ModelServer) -> dict[str, Any]:
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


def app(args: AppArgs) -> Application:
    """The application builder `serve run serve.app:app model=...` calls (Serve turns the
    key=value arguments into `AppArgs`). Resolves the models here, on the driver, so a bad
    reference fails before any replica starts."""
    return build(resolve_models(args), args)


def replica_version(args: ReplicaArgs) -> str:
    """A digest of what the replicas are built from (their arguments and relay's version).
    Serve restarts replicas when it changes; when only the models change, it does not (see
    relay/serving/model_table.py)."""
    built_from = {"relay": __version__, **args.model_dump()}
    return hashlib.sha256(json.dumps(built_from, sort_keys=True).encode()).hexdigest()[:16]


def build(
    models: list[ModelInfo], args: AppArgs, runtime_env: dict[str, Any] | None = None
) -> Application:
    """The application serving already resolved models (`relay serve` resolves them first).
    `runtime_env`: the replicas' (None: the calling driver's, Serve's default)."""
    if args.max_replicas is not None and args.max_replicas > args.replicas:
        scaling: dict[str, Any] = {
            "autoscaling_config": {
                "min_replicas": args.replicas,
                "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests,
            }
        }
    else:
        scaling = {"num_replicas": args.replicas}
    deployment = ModelServer.options(
        name=DEPLOYMENT,
        ray_actor_options={
            "num_cpus": args.num_cpus,
            **({"resources": args.replica_resources} if args.replica_resources else {}),
            **({"runtime_env": runtime_env} if runtime_env is not None else {}),
        },
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        logging_config={"enable_access_log": args.access_log},
        user_config=model_table.user_config(models),
        **scaling,
    )
    replica_args = args.replica_args()
    return ray_private.with_serve_version(deployment, replica_version(replica_args)).bind(
        replica_args
    )
