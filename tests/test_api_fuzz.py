"""Property-based fuzzing of the served HTTP API: Schemathesis, driven by the OpenAPI document
the live server publishes (/openapi.json), against relay/serving/app.py on the session's Ray
cluster, over real HTTP.

One application serves three models on one endpoint (digits: fixed-shape pixels; charlm:
strings and optional fields; regression: a feature count only the loaded model knows), so
every operation of the document is fuzzed: the fixed routes, and each model's KServe v1
`:predict` and v2 `/infer`. Per operation, Hypothesis draws positive (schema-valid) and
negative (schema-invalid) cases from Schemathesis' strategies, derandomized: the same
requests on every run.

What must hold for every answer, whatever was sent: no 5xx; a documented media type, and a
body that conforms to the documented schema where there is one (a 200's predictions or
outputs); schema-invalid data refused with one of relay's 4xx; and relay's own promises —
JSON everywhere but /metrics, every 4xx in relay's error shape `{"error": str, "detail"?:
[{"loc": str, "msg": str, "type": str}]}` (app.py's docstring), `x-model-version` on each
success about a served model.

Every status must be one the document lists for its operation (Schemathesis'
`status_code_conformance`: predict and infer document their refusals as 4XX, the `{name}`
routes relay's 404). Not checked, because the document does not claim it:
`positive_data_acceptance` (the request schemas allow what relay refuses: v2 tensors of any
name, integral floats for strict integer fields).

The document is used as served: it must say each model's own shapes, e.g. regression's
`features` as long as the served model is wide (otherwise hardly any schema-valid regression
instance would reach the model).

The volume is counted, not assumed: each request the server answered, per operation and
status; the test fails below MIN_REQUESTS. (One test with an explicit loop rather than
`schemathesis.pytest.from_fixture`: that loader reads `Node._nodeid`, which pytest 9.2 no
longer has.) A second test sends Schemathesis' schema-valid v1 instances through v2 as
tensors too, the only way generated requests reach the models over v2 with valid values (the
document's InferRequest names each model's tensors, their datatypes and rank, not what their
elements must be), and checks the two protocols agree.
"""

from __future__ import annotations

import json
import re
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from test_serve import make_version, serving

from relay.checkpoints import checkpoint
from relay.records import registry
from relay.tasks import resolve_task_class

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_EXAMPLES = 70  # cases per operation and generation mode (fewer where fewer exist)
AGREEMENT_EXAMPLES = 15  # instance lists per model sent over both protocols
MIN_REQUESTS = 1_000
MODELS = ("digits", "charlm", "regression")
DETERMINISTIC = ("digits", "regression")  # charlm samples: its outputs are not compared
TIMEOUT = 60  # seconds per HTTP call: a wedged server fails the test instead of hanging it
# Paths about one model (relay/serving/routes.py's MODEL_PATH), and the one non-JSON route.
MODEL_PATH = re.compile(r"^/v[12]/models/([^/:]+)")
NOT_JSON = {"/metrics"}

# What the server answered the fuzzing: per operation (label → count, label → status →
# count), and per status as the HTTP session's response hook saw every request.
sent: Counter[str] = Counter()
answered: defaultdict[str, Counter[int]] = defaultdict(Counter)
statuses: Counter[int] = Counter()

SETTINGS = settings(
    derandomize=True,  # the same cases on every run: a failure reproduces
    database=None,
    deadline=None,  # a charlm generation may take a second
    suppress_health_check=list(HealthCheck),
    phases=[phase for phase in Phase if phase is not Phase.explain],  # shrink, but no re-runs
)


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-storage")
    for name in MODELS:
        make_version(root, name, steps=0)  # untrained: the API is under test, not the weights
    return root


@pytest.fixture(scope="module")
def base_url(ray_cluster, storage):
    with serving(
        "test-api-fuzz",
        model=",".join(f"{name}:best" for name in MODELS),
        storage=str(storage),
        num_cpus=0.5,
        max_instances=8,
        max_body_bytes=16_384,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def session():
    """One keep-alive session for every call; its hook counts what the server answered."""

    def count(response: requests.Response, *args, **kwargs) -> None:
        statuses[response.status_code] += 1

    with requests.Session() as http:
        http.hooks["response"].append(count)
        yield http


@pytest.fixture(scope="module")
def api_schema(base_url, storage, session):
    document = session.get(f"{base_url}/openapi.json", timeout=TIMEOUT).json()
    task, _ = checkpoint.load_model(registry.resolve_model(storage, "regression:best").checkpoint)
    width = task.hp.features
    regression = document["components"]["schemas"][f"RegressionInstance{width}"]
    features = regression["properties"]["features"]
    assert features["minItems"] == features["maxItems"] == width
    # The config is explicit, so no schemathesis.toml found on the way up applies. Invalid data
    # must get one of relay's refusals (413: more instances than max_instances); a 5xx is
    # not_a_server_error's to report.
    refusals = ["400", "404", "413", "422", "5xx"]
    config = schemathesis.Config.from_dict(
        {
            "base-url": base_url,
            "checks": {"negative_data_rejection": {"expected-statuses": refusals}},
        }
    )
    schema = schemathesis.openapi.from_dict(document, config=config)
    operations = {result.ok().label for result in schema.get_all_operations()}
    for name in MODELS:  # each model's routes are documented, so they get fuzzed
        assert f"POST /v1/models/{name}:predict" in operations, sorted(operations)
        assert f"POST /v2/models/{name}/infer" in operations, sorted(operations)
    return schema


def relay_json_answers(ctx, response, case) -> None:
    """relay's contract beyond the document: JSON everywhere but /metrics, relay's error shape
    on every 4xx, and `x-model-version` on every success about a served model."""
    path = case.operation.path
    if path in NOT_JSON or response.status_code >= 500:  # a 5xx is not_a_server_error's
        return
    media_type = (response.headers.get("content-type") or [""])[0].split(";")[0].strip()
    assert media_type == "application/json", f"{response.status_code} as {media_type!r}"
    body = json.loads(response.content)
    if 400 <= response.status_code < 500:
        assert isinstance(body, dict) and isinstance(body.get("error"), str), body
        assert set(body) <= {"error", "detail"}, body
        for item in body.get("detail", []):
            assert {type(item.get(key)) for key in ("loc", "msg", "type")} == {str}, item
    elif (match := MODEL_PATH.match(path)) and match.group(1) in MODELS:
        assert response.headers.get("x-model-version"), dict(response.headers)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    relay_json_answers,
]


def fuzz(operation, mode: GenerationMode, session: requests.Session) -> None:
    """MAX_EXAMPLES cases of one operation in one generation mode; raises the first failure
    (shrunk: Hypothesis sends smaller variants until the failing request is minimal)."""

    @settings(SETTINGS, max_examples=MAX_EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(session=session, timeout=TIMEOUT)
        sent[operation.label] += 1
        answered[operation.label][response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except BaseExceptionGroup as failed:  # the checks that failed, and a curl reproduction
            # Schemathesis' FailureGroup is no Exception: Hypothesis would stop at once. As an
            # AssertionError it is shrunk first, to the smallest request that still fails.
            raise AssertionError(str(failed)) from None

    run()


def test_fuzzed_api_has_no_server_errors(api_schema, session):
    """Every operation: schema-valid cases, and for those with a body schema-invalid ones too
    (a GET here has only a free-form string path parameter: nothing to make invalid). At
    least MIN_REQUESTS answered in all, over both protocols of every model, no check failed."""
    failures = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        modes = list(GenerationMode) if operation.method == "post" else [GenerationMode.POSITIVE]
        for mode in modes:
            try:
                fuzz(operation, mode, session)
            except Exception as exc:  # the failed checks, the answer, a curl reproduction
                failure = "".join(traceback.format_exception_only(exc))
                failures.append(f"--- {operation.label} ({mode.value} cases)\n{failure}")
    report = "\n".join(f"{label}: {dict(codes)}" for label, codes in sorted(answered.items()))
    assert not failures, "\n\n".join([*failures, report])
    total = sum(sent.values())
    assert total >= MIN_REQUESTS, f"{total} requests\n{report}"
    assert sum(statuses.values()) >= total, statuses  # the session saw each (and any retry)
    for name in MODELS:
        for label in (f"POST /v1/models/{name}:predict", f"POST /v2/models/{name}/infer"):
            assert sent[label] >= MAX_EXAMPLES, report  # both modes ran, none gave up early
        # Schema-valid instances got through to the model.
        assert answered[f"POST /v1/models/{name}:predict"][200] > 0, report
    assert not [status for status in statuses if status >= 500], statuses


# --- v2 from v1: the same schema-valid instances as tensors -------------------------------------


def as_tensors(rows: list[dict[str, Any]], inputs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A v2 infer body holding `rows` (instances, every row with the same fields and no None:
    see `normalized`) as the tensors GET /v2/models/{name} lists; None when a field's lists
    are ragged (no tensor holds them)."""
    tensors = []
    for spec in inputs:
        name = spec["name"]
        if name not in rows[0]:
            continue  # optional, left out in every row
        values = [row[name] for row in rows]
        shape = [len(rows)]
        if len(spec["shape"]) == 2:
            widths = {len(value) for value in values}
            if len(widths) > 1:
                return None
            shape.append(widths.pop())
            values = [element for value in values for element in value]
        tensors.append({"name": name, "datatype": spec["datatype"], "shape": shape, "data": values})
    return {"inputs": tensors}


def normalized(
    instances: list[Any], schema: dict[str, Any], shorthand: str | None
) -> list[dict[str, Any]]:
    """The instances as objects (a bare value is the task's `shorthand` field, as the server
    reads it) with the same fields in every row: a field some rows leave out gets its default
    there, and one that is None anywhere (a tensor holds no null) is left out of all. The same
    instances go to v1, so both protocols are asked the same thing."""
    properties = schema["properties"]
    instances = [row if isinstance(row, dict) else {shorthand: row} for row in instances]
    fields = {name for row in instances for name in row}
    rows = [
        {name: row.get(name, properties[name].get("default")) for name in fields}
        for row in instances
    ]
    dropped = {name for row in rows for name, value in row.items() if value is None}
    return [{name: value for name, value in row.items() if name not in dropped} for row in rows]


def as_rows(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """v2 output tensors back to one dict per row, as v1's predictions."""
    rows: list[dict[str, Any]] = []
    for tensor in outputs:
        data, shape = tensor["data"], tensor["shape"]
        width = shape[1] if len(shape) == 2 else None
        for r in range(shape[0]):
            if r == len(rows):
                rows.append({})
            rows[r][tensor["name"]] = data[r * width : (r + 1) * width] if width else data[r]
    return rows


def agrees(operation, metadata: dict, instance_schema: dict, base_url: str, session) -> Counter:
    """AGREEMENT_EXAMPLES lists of schema-valid instances for one model, each sent to v1 and as
    tensors to v2; the v1 statuses they got."""
    name = metadata["name"]
    got: Counter[int] = Counter()

    @settings(SETTINGS, max_examples=AGREEMENT_EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case) -> None:
        shorthand = resolve_task_class(name).Instance.shorthand
        instances = normalized(case.body["instances"], instance_schema, shorthand)
        body = as_tensors(instances, metadata["inputs"])
        assume(body is not None)
        v1 = session.post(
            f"{base_url}/v1/models/{name}:predict", json={"instances": instances}, timeout=TIMEOUT
        )
        v2 = session.post(f"{base_url}/v2/models/{name}/infer", json=body, timeout=TIMEOUT)
        sent_as = f"v1 {json.dumps({'instances': instances})}\nv2 {json.dumps(body)}"
        answers = f"{sent_as}\n→ v1 {v1.status_code} {v1.text}\n→ v2 {v2.status_code} {v2.text}"
        got[v1.status_code] += 1
        assert v1.status_code < 500 and v2.status_code < 500, answers
        assert v1.status_code == v2.status_code, answers
        if v1.status_code != 200:
            return
        outputs = v2.json()["outputs"]
        assert [o["name"] for o in outputs] == [o["name"] for o in metadata["outputs"]], answers
        if name in DETERMINISTIC:
            predictions = v1.json()["predictions"]
            served = as_rows(outputs)
            assert len(served) == len(predictions), answers
            for row, prediction in zip(served, predictions, strict=True):
                for key, value in prediction.items():
                    assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), answers

    run()
    return got


def test_v2_infer_agrees_with_v1_predict(api_schema, base_url, session):
    """Schemathesis' schema-valid v1 instances, sent to v1 and as tensors to v2: the same
    status, no 5xx, and for a deterministic model the same predictions."""
    schemas = api_schema.raw_schema["components"]["schemas"]
    for name in MODELS:
        metadata = session.get(f"{base_url}/v2/models/{name}", timeout=TIMEOUT).json()
        item = schemas[f"{name}_PredictRequest"]["properties"]["instances"]["items"]
        # The object, or beside it (a task with a shorthand) the bare value of one field.
        (ref,) = [i["$ref"] for i in item.get("anyOf", [item]) if "$ref" in i]
        instance_schema = schemas[ref.rsplit("/", 1)[-1]]
        operation = api_schema[f"/v1/models/{name}:predict"]["POST"]
        got = agrees(operation, metadata, instance_schema, base_url, session)
        assert got[200] > 0, (name, got)  # some reached the model
