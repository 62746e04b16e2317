"""The KServe v2 / Open Inference Protocol's named tensors ↔ a task's pydantic schemas.

Pure (no Ray, no FastAPI), so the routes stay thin. `Instance` gives the input tensors and
`Prediction` the outputs, one per field, batch dimension first. A request is checked here only
as tensors (names, datatypes, shapes, elements); its rows then go through the task's own schema
(`task.validate_instances`), so ranges and model-dependent checks stay in one place.

Error locations (`detail[].loc`, dotted as web.error_detail's) name tensors, not instances:
`inputs.<name>` (unknown, missing, given twice), `inputs.<name>.<key>` (its `shape`,
`datatype`, `data`…), `inputs.<name>.<row>[.<col>]` (an element by its coordinates in the
tensor, whether the data came flat or nested; further parts point inside a BYTES-JSON value),
`inputs.*.<row>` (a whole instance), `inputs.<index>` (an entry without a name); `outputs.…`
alike.
"""

from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from relay.serving import json_limits

# JSON-schema scalar types → v2 datatypes. Floats are FP64: a pydantic float is a Python float
# (a double) and JSON numbers are doubles, so FP64 states what relay keeps and returns; FP32
# would promise a rounding relay never does (a model's own float32 cast is its business).
SCALARS = {"integer": "INT64", "number": "FP64", "boolean": "BOOL", "string": "BYTES"}
INT64 = (-(2**63), 2**63 - 1)
# What a request may send for each: clients send the width their arrays have (numpy float32,
# int32), and in JSON every width reads alike; the elements are checked against the spec's.
ACCEPTED = {
    "FP64": {"FP16", "FP32", "FP64"},
    "INT64": {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"},
    "BOOL": {"BOOL"},
    "BYTES": {"BYTES"},
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # batch dimension first; -1: any size
    optional: bool = False  # may be left out of a request (the field has a default, or is nullable)
    as_json: bool = False  # BYTES whose elements are each value's JSON text (dicts, objects…)
    none_if_omitted: bool = False  # nullable without a default: left out means None

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class InferError(Exception):
    """A request the protocol refuses: `status` (422, 413), a message, and detail items
    {"loc", "msg", "type"} as web.error_detail gives them — ready for web.error()."""

    def __init__(self, status: int, message: str, detail: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail


def _fail(loc: tuple, msg: str, kind: str, status: int = 422) -> InferError:
    where = ".".join(str(part) for part in loc)
    return InferError(status, f"{where}: {msg}", [{"loc": where, "msg": msg, "type": kind}])


@functools.cache  # schemas are static per class; building a JSON schema is not free
def tensor_specs(model: type[BaseModel]) -> tuple[TensorSpec, ...]:
    """One tensor per field of `model`, in field order (from its JSON schema, so Annotated
    constraints such as a list's fixed length are seen)."""
    schema = model.model_json_schema()
    required = set(schema.get("required", ()))
    return tuple(_spec(name, prop, name in required) for name, prop in schema["properties"].items())


def _spec(name: str, prop: dict[str, Any], required: bool) -> TensorSpec:
    options = prop.get("anyOf", [prop])
    kept = [option for option in options if option.get("type") != "null"]
    nullable = len(kept) < len(options)  # `int | None`: the tensor is an int, and optional
    flags = {"optional": not required or nullable, "none_if_omitted": required and nullable}
    if len(kept) == 1:
        kind, items = kept[0].get("type"), kept[0].get("items", {})
        if kind in SCALARS:
            return TensorSpec(name, SCALARS[kind], (-1,), **flags)
        if kind == "array" and items.get("type") in SCALARS:
            n = kept[0].get("minItems")
            width = n if n is not None and n == kept[0].get("maxItems") else -1
            return TensorSpec(name, SCALARS[items["type"]], (-1, width), **flags)
    # Dicts, nested models, unions: no tensor form, so one JSON text per row.
    return TensorSpec(name, "BYTES", (-1,), as_json=True, **flags)


def model_metadata(
    name: str,
    versions: list[str],
    platform: str,
    instance_model: type[BaseModel],
    prediction_model: type[BaseModel],
) -> dict[str, Any]:
    """The body of `GET /v2/models/{name}`."""
    return {
        "name": name,
        "versions": versions,
        "platform": platform,
        "inputs": [spec.metadata() for spec in tensor_specs(instance_model)],
        "outputs": [spec.metadata() for spec in tensor_specs(prediction_model)],
    }


def _entries(
    payload: dict[str, Any], where: str, model: type[BaseModel], keys: set[str]
) -> list[tuple[TensorSpec, dict[str, Any]]]:
    """The named entries of `payload[where]` as (spec, entry): each an object with a known,
    unique name and no keys beyond `keys`."""
    entries, specs, seen = payload[where], {s.name: s for s in tensor_specs(model)}, []
    if not isinstance(entries, list):
        raise _fail((where,), "expected a list", "list_type")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _fail((where, index), 'expected an object with a "name" string', "dict_type")
        name = entry["name"]
        if name not in specs:
            known = ", ".join(specs)
            raise _fail((where, name), f"unknown {where[:-1]} (known: {known})", "extra_forbidden")
        if name in (spec.name for spec, _ in seen):
            raise _fail((where, name), f"{where[:-1]} given twice", "duplicate")
        if extra := sorted(set(entry) - keys):
            raise _fail((where, name, extra[0]), "unknown field", "extra_forbidden")
        if not isinstance(entry.get("parameters", {}), dict):
            raise _fail((where, name, "parameters"), "expected an object", "dict_type")
        seen.append((specs[name], entry))
    return seen


def requested_outputs(payload: dict[str, Any], prediction_model: type[BaseModel]) -> list[str]:
    """The output names a request asks for (all, in spec order, when it names none); check
    this before the model runs, so an unknown name costs no forward pass."""
    if not isinstance(payload, dict) or not payload.get("outputs"):
        return [spec.name for spec in tensor_specs(prediction_model)]
    keys = {"name", "parameters"}
    return [spec.name for spec, _ in _entries(payload, "outputs", prediction_model, keys)]


def instances_from_infer_request(
    payload: Any, instance_model: type[BaseModel], max_instances: int
) -> list[dict[str, Any]]:
    """The raw instances (one dict per batch row) of a v2 infer request body, for the task's
    `validate_instances`; raises InferError for anything that is not tensors of the spec."""
    if not isinstance(payload, dict):
        raise _fail(("body",), "expected a JSON object", "dict_type")
    if extra := sorted(set(payload) - {"id", "parameters", "inputs", "outputs"}):
        raise _fail((extra[0],), "unknown field", "extra_forbidden")
    for key, kind in (("id", str), ("parameters", dict), ("outputs", list)):
        if key in payload and not isinstance(payload[key], kind):
            raise _fail((key,), f"expected a {kind.__name__}", f"{kind.__name__}_type")
    if not isinstance(payload.get("inputs"), list) or not payload["inputs"]:
        raise _fail(("inputs",), "expected a non-empty list of tensors", "list_type")
    keys = {"name", "shape", "datatype", "data", "parameters"}
    given = _entries(payload, "inputs", instance_model, keys)
    sent = {spec.name for spec, _ in given}
    omitted = [spec for spec in tensor_specs(instance_model) if spec.name not in sent]
    for spec in omitted:
        if not spec.optional:
            raise _fail(("inputs", spec.name), "required input missing", "missing")
    shapes = [_shape(spec, entry) for spec, entry in given]
    batch = shapes[0][0]  # every input must agree on it (checked before any data is read)
    for (spec, _), shape in zip(given, shapes, strict=True):
        if shape[0] != batch:
            msg = f"batch size {shape[0]} differs from {given[0][0].name}'s {batch}"
            raise _fail(("inputs", spec.name, "shape"), msg, "shape")
    if not 0 < batch <= max_instances:
        msg = f"{batch} instances; at least 1 and at most {max_instances} per request"
        where = ("inputs", given[0][0].name, "shape")
        raise _fail(where, msg, "too_long" if batch else "too_short", 413 if batch else 422)
    # A nullable field without a default is None when left out (a tensor cannot hold null).
    rows = [{s.name: None for s in omitted if s.none_if_omitted} for _ in range(batch)]
    for (spec, entry), shape in zip(given, shapes, strict=True):
        flat = _elements(spec, shape, entry["data"])
        width = shape[-1]  # of a [batch, width] tensor, row r is elements r*width … (r+1)*width-1
        for r, row in enumerate(rows):
            row[spec.name] = flat[r * width : (r + 1) * width] if len(shape) == 2 else flat[r]
    return rows


def _shape(spec: TensorSpec, entry: dict[str, Any]) -> list[int]:
    loc = ("inputs", spec.name)
    if entry.get("datatype") not in ACCEPTED[spec.datatype]:
        accepted = ", ".join(sorted(ACCEPTED[spec.datatype]))
        msg = f"expected {spec.datatype} (or {accepted}), got {entry.get('datatype')!r}"
        raise _fail((*loc, "datatype"), msg, "datatype")
    shape = entry.get("shape")
    valid = isinstance(shape, list) and len(shape) == len(spec.shape)
    if not valid or not all(type(d) is int and d >= 0 for d in shape):  # type(): no bools
        msg = f"expected {len(spec.shape)} sizes ≥ 0 (spec {list(spec.shape)}), got {shape!r}"
        raise _fail((*loc, "shape"), msg, "shape")
    for size, fixed in zip(shape[1:], spec.shape[1:], strict=True):
        if fixed != -1 and size != fixed:
            raise _fail((*loc, "shape"), f"expected {list(spec.shape)}, got {shape}", "shape")
    if "data" not in entry:
        raise _fail((*loc, "data"), "missing", "missing")
    return shape


def _elements(spec: TensorSpec, shape: list[int], data: Any) -> list[Any]:
    """`data` flat (row-major) or nested exactly as `shape`, as a checked flat list."""
    loc = ("inputs", spec.name, "data")
    if not isinstance(data, list):
        raise _fail(loc, "expected a list", "list_type")
    if any(isinstance(x, list) for x in data):  # nested: level by level, exactly as `shape`
        mismatch = _fail(loc, f"nested data does not match shape {shape}", "shape")
        if len(data) != shape[0]:
            raise mismatch
        for size in shape[1:]:
            if not all(isinstance(x, list) and len(x) == size for x in data):
                raise mismatch
            data = [element for row in data for element in row]
        if any(isinstance(x, list) for x in data):
            raise mismatch
    if len(data) != math.prod(shape):
        msg = f"{len(data)} elements for shape {shape} ({math.prod(shape)})"
        raise _fail(loc, msg, "shape")
    width = shape[1] if len(shape) == 2 else 0
    return [
        _element(spec, value, divmod(k, width) if width else (k,)) for k, value in enumerate(data)
    ]


# What each datatype's JSON elements may be, for the error's message and type.
EXPECTED = {
    "BOOL": ("a boolean", "bool_type"),
    "INT64": ("an integer in INT64's range", "int_type"),
    "FP64": ("a finite number", "finite_number"),
    "BYTES": ("a string", "string_type"),
}


def _element(spec: TensorSpec, value: Any, at: tuple[int, ...]) -> Any:
    # type(), not isinstance(): a bool is no INT64 or FP64. Ints are fine for FP64 (JSON does
    # not tell 2 from 2.0), but 2.0 is no INT64: strict, as the schemas are.
    ok = {
        "BOOL": isinstance(value, bool),
        "INT64": type(value) is int and INT64[0] <= value <= INT64[1],
        "FP64": type(value) is int or (type(value) is float and math.isfinite(value)),
        "BYTES": isinstance(value, str),
    }[spec.datatype]
    loc = ("inputs", spec.name, *at)
    if not ok:
        expected, kind = EXPECTED[spec.datatype]
        raise _fail(loc, f"expected {expected}", kind)
    if spec.as_json:  # its structure bounded as a body's is (relay/serving/json_limits.py)
        try:
            json_limits.check(value, json_limits.CONTAINERS_PER_INSTANCE)
        except json_limits.TooMuchJSON as exc:
            raise _fail(loc, str(exc), exc.kind) from None
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise _fail(loc, f"expected JSON text: {exc}", "json_invalid") from None
    return value


def validation_error(exc: ValidationError, instance_model: type[BaseModel]) -> InferError:
    """The task schema's errors (locations: row, field, item…) as a 422 in tensor terms:
    (3, "pixels", 17) → `inputs.pixels.3.17`; (0, "features") → `inputs.features.0`; an
    error of a whole instance, (2,) → `inputs.*.2`."""
    names = {spec.name for spec in tensor_specs(instance_model)}
    detail = []
    for item in exc.errors(include_url=False):
        row, *rest = item["loc"]
        field = rest.pop(0) if rest and rest[0] in names else "*"
        loc = ".".join(str(part) for part in ("inputs", field, row, *rest))
        detail.append({"loc": loc, "msg": item["msg"], "type": item["type"]})
    return InferError(422, "invalid inputs", detail)


def infer_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    predictions: list[dict[str, Any]],
    prediction_model: type[BaseModel],
    outputs: list[str] | None = None,
) -> dict[str, Any]:
    """The v2 infer response: one tensor per output (those in `outputs`, as requested_outputs
    gives them; None: all), data flat and row-major. `predictions` are the model_dump()s."""
    specs = {spec.name: spec for spec in tensor_specs(prediction_model)}
    body: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        body["model_version"] = model_version
    if request_id is not None:
        body["id"] = request_id
    wanted = outputs if outputs is not None else list(specs)
    body["outputs"] = [_output(specs[name], [p[name] for p in predictions]) for name in wanted]
    return body


def _output(spec: TensorSpec, values: list[Any]) -> dict[str, Any]:
    shape: list[int] = [len(values)]
    if spec.as_json:
        data = [json.dumps(value, separators=(",", ":")) for value in values]
    elif len(spec.shape) == 2:
        widths = {len(value) for value in values}
        if len(widths) > 1:  # a server bug, not the client's: a tensor cannot be ragged
            raise ValueError(f"output {spec.name!r} has rows of lengths {sorted(widths)}")
        shape.append(widths.pop() if widths else max(spec.shape[1], 0))
        data = [element for value in values for element in value]
    else:
        data = values
    if not spec.as_json and None in data:  # a server bug too: no datatype holds null
        raise ValueError(f"output {spec.name!r} holds None")
    return {"name": spec.name, "datatype": spec.datatype, "shape": shape, "data": data}


# --- for the OpenAPI document only (the routes parse bodies with the functions above) ---------


class RequestTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="An input of the model (GET /v2/models/{name} lists them).")
    shape: list[int] = Field(description="Batch size first.")
    datatype: str = Field(description="BOOL, INT8…INT64, UINT8…UINT64, FP16…FP64, or BYTES.")
    data: list[Any] = Field(description="The elements, flat (row-major) or nested as `shape`.")
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = Field(None, description="Default: every output.")


def infer_request_model(
    prefix: str, instance_model: type[BaseModel], prediction_model: type[BaseModel]
) -> type[BaseModel]:
    """InferRequest as one model's API documents it: each input tensor by its name, with the
    datatypes it accepts and its rank; the outputs a request may ask for by name. `prefix`
    keeps the schemas of several models on one endpoint apart."""
    inputs = []
    for spec in tensor_specs(instance_model):
        rank = len(spec.shape)
        inputs.append(
            create_model(
                f"{prefix}_{spec.name}_Input",
                __base__=RequestTensor,
                name=(Literal[spec.name], ...),
                datatype=(Literal[tuple(sorted(ACCEPTED[spec.datatype]))], ...),
                shape=(
                    list[int],
                    Field(
                        min_length=rank,
                        max_length=rank,
                        description=f"{list(spec.shape)}: the batch size first (-1: any)",
                    ),
                ),
            )
        )
    tensor = inputs[0]
    if len(inputs) > 1:  # which schema applies: the one its name names
        tensor = Annotated[functools.reduce(operator.or_, inputs), Field(discriminator="name")]
    output_names = tuple(spec.name for spec in tensor_specs(prediction_model))
    output = create_model(
        f"{prefix}_RequestedOutput",
        __base__=RequestedOutput,
        name=(Literal[output_names], ...),
    )
    return create_model(
        f"{prefix}_InferRequest",
        __base__=InferRequest,
        inputs=(list[tensor], Field(min_length=1)),
        outputs=(list[output] | None, Field(None, description="Default: every output.")),
    )


class ResponseTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[ResponseTensor]
