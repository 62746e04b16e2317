"""The Serve application: one registered model behind a FastAPI ingress, batched forwards.

`relay serve digits:best` runs it (relay/serving/command.py), `serve run serve.app:app
model=digits:best` too (serve/app.py re-exports `app`), and `serve deploy serve/config.yaml`
on a running cluster. Any field of `AppArgs` can follow `serve run` as key=value.

Protocol (KServe / TF-Serving v1 REST):

    POST /v1/models/{name}:predict   {"instances": [...]} → {"predictions": [...]}
    GET  /v1/models/{name}           {"name", "ready", "version", "task", ...}
    GET  /v1/models/{name}/stats     batch sizes this replica has run (a histogram)
    GET  /healthz                    {"status": "ok"}
    GET  /docs                       OpenAPI (Swagger UI, served offline), with the task's schema

Every response carries `x-model-version`: the version that answered.

`{name}` is the registry model name ("digits" for `digits:best`). What one instance and one
prediction look like is the task's business (`Task.Instance` / `Task.Prediction`, e.g. digits:
64 pixels 0–16 → {"label", "probabilities"}). Every bad request gets a 4xx JSON body
`{"error": ..., "detail": [{"loc": "instances.0.pixels.3", "msg": ..., "type": ...}]}` and
never reaches the model: malformed JSON 400, unknown model 404, a body over `max_body_bytes`
(counted as it arrives, so chunked bodies too) or more than `max_instances` instances 413, any
instance the task's schema rejects (wrong type or shape, missing or unknown field, NaN/inf, out
of range) 422 naming its index. Valid instances from concurrent requests are run together:
one forward serves many callers, and a caller alone is not held back for company
(relay/serving/batching.py; `batching: serve` uses Ray Serve's `@serve.batch` instead).

Which ingress carries the requests to the replicas (HAProxy or Serve's Python proxy) is
relay/serving/ingress.py's business; the application is the same for both.
"""

import asyncio
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from ray import serve
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.config import NAME_PATTERN
from relay.serving.batching import AdaptiveBatcher
from relay.serving.web import (
    BodyLimit,
    ResponseHeaders,
    document,
    error,
    error_detail,
    schema_ref,
)

MIB = 1 << 20
# On every response: the model version that answered (the registry's number, or the reference
# when the model was served from a run id or a checkpoint directory).
VERSION_HEADER = "x-model-version"


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
        self.batcher = AdaptiveBatcher(self.forward, args.max_batch_size, args.batch_wait_timeout_s)
        self.forward_serve_batched.set_max_batch_size(args.max_batch_size)
        self.forward_serve_batched.set_batch_wait_timeout_s(args.batch_wait_timeout_s)

    async def forward(self, instances: list[BaseModel]) -> list[dict[str, Any]]:
        """One forward pass over a batch of validated instances."""
        self.batch_sizes[len(instances)] += 1
        loop = asyncio.get_running_loop()
        predictions = await loop.run_in_executor(
            self.executor, self.task.predict, self.model, instances
        )
        return [prediction.model_dump(mode="json") for prediction in predictions]

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)  # reset per app in __init__
    async def forward_serve_batched(self, instances: list[BaseModel]) -> list[dict[str, Any]]:
        return await self.forward(instances)

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
        if self.args.batching == "adaptive":
            predictions = await self.batcher.submit(instances)
        else:
            predictions = await asyncio.gather(*(self.forward_serve_batched(i) for i in instances))
        return JSONResponse({"predictions": predictions})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self)


def build_http_app(server: ModelServer) -> FastAPI:
    info, task = server.info, server.task
    # FastAPI's own /docs page loads Swagger UI from a CDN: blank on a machine without internet
    # access. fastapi-offline's serves the same page from files in the package
    # (/static-offline-docs); ReDoc, CDN-only in FastAPI too, is left out.
    api = FastAPIOffline(
        title=f"relay: {info.name}",
        version=str(info.version),
        description=f"Model `{info.reference}` (task `{info.task}`), KServe v1 protocol.",
        redoc_url=None,
    )
    api.add_middleware(BodyLimit, max_bytes=server.args.max_body_bytes)
    # Added last, so outermost: the 413s of the body limit carry it too.
    api.add_middleware(ResponseHeaders, headers={VERSION_HEADER: str(info.version)})
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
