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

Here: the replica (`ModelServer`) and the builders (`app`, `build`). The arguments are
relay/serving/args.py's, the FastAPI app and its routes relay/serving/routes.py's, how bodies
are parsed and a model is shown relay/serving/answers.py's.
"""

import asyncio
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.deployment import Application

from relay.runtime import ray_private
from relay.serving import metrics, model_table, staging
from relay.serving import open_inference as v2
from relay.serving.answers import json_or_non_finite, parse_json, shown, shown_version
from relay.serving.args import AppArgs, ReplicaArgs, replica_version
from relay.serving.batching import AdaptiveBatcher
from relay.serving.model_table import LoadedModel, ModelInfo
from relay.serving.routes import build_http_app
from relay.serving.web import error, error_detail

DEPLOYMENT = "relay-models"


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


def app(args: AppArgs) -> Application:
    """The application builder `serve run serve.app:app model=...` calls (Serve turns the
    key=value arguments into `AppArgs`). Resolves the models here, on the driver, so a bad
    reference fails before any replica starts."""
    return build(resolve_models(args), args)


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
