"""serve run serve.app:app model=digits:best

Serve one registered model over HTTP with Ray Serve (from the repository root; any field of
`AppArgs` can follow as key=value, e.g. `max_batch_size=64 replicas=2`). `relay serve digits:best`
does the same with --host/--port flags, and `serve deploy serve/config.yaml` on a running cluster.

Protocol (KServe / TF-Serving v1 REST):

    POST /v1/models/{name}:predict   {"instances": [...]} → {"predictions": [...]}
    GET  /v1/models/{name}           {"name", "ready", "version", "task", ...}
    GET  /v1/models/{name}/stats     batch sizes this replica has run (a histogram)
    GET  /healthz                    {"status": "ok"}
    GET  /docs                       OpenAPI (Swagger UI), with the task's instance schema

`{name}` is the registry model name ("digits" for `digits:best`). What one instance and one
prediction look like is the task's business (`Task.Instance` / `Task.Prediction`, e.g. digits:
64 pixels 0–16 → {"label", "probabilities"}). Every bad request gets a 4xx JSON body
`{"error": ..., "detail": [{"loc": "instances.0.pixels.3", "msg": ..., "type": ...}]}` and
never reaches the model: malformed JSON 400, unknown model 404, a body over `max_body_bytes`
(counted as it arrives, so chunked bodies too) or more than `max_instances` instances 413, any
instance the task's schema rejects (wrong type or shape, missing or unknown field, NaN/inf, out
of range) 422 naming its index. Valid instances from concurrent requests are run together:
each instance is one item of a `@serve.batch` queue, so one forward serves many callers.

Binding: loopback only unless asked. Serve's proxy listens on `http_options` host:port, which
relay always sets explicitly (`relay serve --host/--port`, serve/config.yaml); Serve 2.60's own
default for `serve run` is also 127.0.0.1:8000 (`HTTPOptions.host` = localhost), while a
deploy config that omits `http_options.host` binds 0.0.0.0 — hence config.yaml spells it out.

Direct ingress (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`) stays off; the user-facing endpoint is
Serve's proxy on host:port. With the flag (read from the cluster's environment, so it must be set
before `ray.init`: `relay.cluster.connect(direct_ingress=True)`), each ingress replica also runs
its own HTTP server, bound to the same host, on a port Serve picks from 30000–31000
(ray/serve/_private/constants.py) — and the proxy keeps serving host:port exactly as before.
bench/serve_load.py, digits MLP, 32 concurrent clients, requests/s and p99 on this 2-core machine:
plain FastAPI 4750 / 13 ms; relay via 127.0.0.1:8000 (proxy) 364 / 141 ms with the flag, 381 /
138 ms without; the replica's own port 2160 / 21 ms. So the flag speeds up only an endpoint
clients cannot know in advance (no public API reports it). Pinning that range to the user's port
(MIN=8000, MAX=8001) served the first deployment but the next `serve.run` failed (the port is
still held or quarantined), works for one replica only, and every app deletion then waits out a
30 s drain (`RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`). HAProxy ingress
(`RAY_SERVE_ENABLE_HA_PROXY=1`) is no way out: its stats and metrics frontends bind every
interface (haproxy_templates.py). Behind the proxy, the lever for throughput is instances per
request: one request may carry up to `max_instances`, and they share a forward.
"""

import asyncio
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from ray import serve
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.config import NAME_PATTERN

MIB = 1 << 20


class AppArgs(BaseModel):
    """What `serve run serve.app:app key=value ...` and serve/config.yaml's `args` accept.

    Values arrive as strings from the command line; pydantic converts them ("0.5" → 0.5).
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="A registry reference: name:best, name:latest, name:N, a run id, or a "
        "checkpoint directory."
    )
    storage: str | None = Field(None, description="Storage root; null: $RELAY_HOME, ~/relay.")
    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,  # as registry names: one URL path segment
        description="Model name in URLs; null: the registry model name (or the task's).",
    )
    replicas: int = Field(1, ge=1, description="Replicas (the minimum when autoscaling).")
    max_replicas: int | None = Field(
        None, ge=1, description="Autoscale up to this many replicas; null: a fixed count."
    )
    target_ongoing_requests: float = Field(
        32, gt=0, description="Autoscaling target of in-flight requests per replica."
    )
    num_cpus: float = Field(0.5, gt=0, description="CPUs each replica reserves.")
    max_batch_size: int = Field(32, ge=1, description="Instances per forward pass (1: none).")
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="How long a forward waits for its batch to fill."
    )
    max_instances: int = Field(256, ge=1, description="Instances one request may carry.")
    max_body_bytes: int = Field(MIB, ge=1, description="Largest request body, in bytes.")
    # Serve's default (5) queues requests at the proxy long before a replica is busy; at 256 a
    # replica holds enough requests in flight to fill its batches (RAY-NOTES, 32 clients: 20 →
    # 283 req/s together with the access log off).
    max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests per replica.")
    access_log: bool = Field(False, description="Log every request (a log line costs time).")


class ModelInfo(BaseModel):
    """The resolved model a deployment serves; resolved once, on the driver, so that every
    replica loads the same checkpoint even if a newer version is registered meanwhile."""

    name: str
    reference: str  # e.g. "digits:3", a run id, or a checkpoint path
    version: int | str
    task: str
    checkpoint: str


def resolve(args: AppArgs) -> ModelInfo:
    """Registry reference → checkpoint. Raises KeyError (no such model), TypeError (its task
    cannot be served) or OSError (the checkpoint is unreadable)."""
    from relay import checkpoint, config, registry
    from relay.tasks import resolve_task_class

    found = registry.resolve_model(config.resolve_storage(args.storage), args.model)
    task_name = checkpoint.read_meta(found.checkpoint)["config"]["task"]
    if not resolve_task_class(task_name).servable():
        raise TypeError(
            f"task {task_name!r} cannot be served: it needs Instance and Prediction schemas and "
            "a predict() method (see relay/tasks/base.py)"
        )
    version = found.version or {}
    return ModelInfo(
        name=args.name or version.get("model") or registry.default_model_name(task_name),
        reference=found.reference,
        version=version.get("version", found.reference),
        task=task_name,
        checkpoint=str(found.checkpoint),
    )


# --- HTTP plumbing ---------------------------------------------------------------------------


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


class BodyLimit:
    """Pure ASGI middleware: read the whole request body before anything parses it, answering
    413 as soon as it exceeds `max_bytes` — by Content-Length when there is one, else by
    counting chunks as they arrive (chunked transfer has no length to check up front)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error(400, "invalid Content-Length")(scope, receive, send)
            if int(length) > self.max_bytes:
                return await self.too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send) -> None:
        await error(413, f"request body exceeds {self.max_bytes} bytes")(scope, receive, send)


def document(api: FastAPI, *models: type[BaseModel]) -> None:
    """Put `models` (and the models they nest) into the OpenAPI components, so the predict
    route can point at its request schema although it parses the body itself."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[model.__name__] = spec
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi


def schema_ref(model: type[BaseModel]) -> dict[str, Any]:
    ref = f"#/components/schemas/{model.__name__}"
    return {"content": {"application/json": {"schema": {"$ref": ref}}}}


# --- the deployment --------------------------------------------------------------------------


@serve.deployment
@serve.ingress()  # the FastAPI app is built per replica: its routes need the loaded task
class ModelServer:
    def __init__(self, info: ModelInfo, args: AppArgs) -> None:
        import torch

        from relay.checkpoint import load_model

        # Threads beyond the reserved CPUs only fight the other replicas (and Ray) for cores.
        torch.set_num_threads(max(1, int(args.num_cpus)))
        self.info, self.args = info, args
        self.task, self.model = load_model(info.checkpoint)
        # One forward at a time, off the event loop: a long generate() must not stall health
        # checks or the intake of the next batch.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.batch_sizes: Counter[int] = Counter()
        self.started = time.time()
        self.predict_batched.set_max_batch_size(args.max_batch_size)
        self.predict_batched.set_batch_wait_timeout_s(args.batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)  # reset per app in __init__
    async def predict_batched(self, instances: list[BaseModel]) -> list[dict[str, Any]]:
        self.batch_sizes[len(instances)] += 1
        loop = asyncio.get_running_loop()
        predictions = await loop.run_in_executor(
            self.executor, self.task.predict, self.model, instances
        )
        return [prediction.model_dump(mode="json") for prediction in predictions]

    def metadata(self) -> dict[str, Any]:
        return {
            **self.info.model_dump(),
            "ready": True,
            "max_batch_size": self.args.max_batch_size,
            "max_instances": self.args.max_instances,
        }

    def stats(self) -> dict[str, Any]:
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "batches": sum(self.batch_sizes.values()),
            "instances": sum(size * n for size, n in self.batch_sizes.items()),
            "max_batch_size_seen": max(self.batch_sizes, default=0),
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "uptime_s": round(time.time() - self.started, 3),
        }

    async def predict(self, name: str, body: bytes) -> JSONResponse:
        if name != self.info.name:
            return error(404, f"unknown model {name!r}; this server has {self.info.name!r}")
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a 5000-digit number,
            return error(400, f"malformed JSON: {exc}")  # nesting deeper than Python recurses
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
            instances = self.task.validate_instances(raw)
        except ValidationError as exc:
            return error(422, "invalid instances", error_detail(exc, ("instances",)))
        predictions = await asyncio.gather(*(self.predict_batched(i) for i in instances))
        return JSONResponse({"predictions": predictions})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self)


def build_http_app(server: ModelServer) -> FastAPI:
    info, task = server.info, server.task
    api = FastAPI(
        title=f"relay: {info.name}",
        version=str(info.version),
        description=f"Model `{info.reference}` (task `{info.task}`), KServe v1 protocol.",
    )
    api.add_middleware(BodyLimit, max_bytes=server.args.max_body_bytes)
    # The request and response schemas, for /docs only (predict() checks the body itself).
    limits = Field(min_length=1, max_length=server.args.max_instances)
    request_model = create_model("PredictRequest", instances=(list[task.Instance], limits))
    response_model = create_model("PredictResponse", predictions=(list[task.Prediction], ...))
    document(api, request_model, response_model)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @api.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models/{name}")
    async def model_metadata(name: str) -> JSONResponse:
        if name != info.name:
            return error(404, f"unknown model {name!r}; this server has {info.name!r}")
        return JSONResponse(server.metadata())

    @api.get("/v1/models/{name}/stats")
    async def model_stats(name: str) -> JSONResponse:
        if name != info.name:
            return error(404, f"unknown model {name!r}; this server has {info.name!r}")
        return JSONResponse(server.stats())

    @api.post(
        "/v1/models/{name}:predict",
        openapi_extra={"requestBody": {"required": True, **schema_ref(request_model)}},
        responses={200: schema_ref(response_model)},
    )
    async def predict(name: str, request: Request) -> JSONResponse:
        # The body is parsed here, not by FastAPI, so every failure gets relay's error shape
        # and the task can check what depends on the model (validation context).
        return await server.predict(name, await request.body())

    return api


def app(args: AppArgs) -> Application:
    """The application builder `serve run serve.app:app model=...` calls (Serve turns the
    key=value arguments into `AppArgs`). Resolves the model here, on the driver, so a bad
    reference fails before any replica starts."""
    return build(resolve(args), args)


def build(info: ModelInfo, args: AppArgs) -> Application:
    """The application serving an already resolved model (`relay serve` resolves it first)."""
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
    return ModelServer.options(
        name=f"relay-{info.name}",
        ray_actor_options={"num_cpus": args.num_cpus},
        max_ongoing_requests=args.max_ongoing_requests,
        logging_config={"enable_access_log": args.access_log},
        **scaling,
    ).bind(info, args)
