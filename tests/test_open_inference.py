"""The Open Inference Protocol (KServe v2) mapping, with the real task schemas (no Ray)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from pydantic import Field, TypeAdapter, ValidationError, model_validator

from relay.serving.open_inference import (
    InferError,
    infer_response,
    instances_from_infer_request,
    model_metadata,
    requested_outputs,
    tensor_specs,
    validation_error,
)
from relay.tasks import build_task, resolve_task_class
from relay.tasks.base import InstanceSchema

pytestmark = pytest.mark.timeout(60)

MAX = 8  # max_instances for these tests


def digits_images(n: int) -> list[list[float]]:
    from sklearn.datasets import load_digits

    return load_digits().data[:n].tolist()


def specs_by_name(model) -> dict[str, tuple[str, list[int], bool]]:
    return {s.name: (s.datatype, list(s.shape), s.optional) for s in tensor_specs(model)}


def digits_request(images: list[list[float]], nested: bool = False) -> dict:
    data = images if nested else [pixel for image in images for pixel in image]
    pixels = {"name": "pixels", "shape": [len(images), 64], "datatype": "FP64", "data": data}
    return {"id": "req-1", "inputs": [pixels]}


def refused(payload, model, max_instances: int = MAX) -> InferError:
    with pytest.raises(InferError) as caught:
        instances_from_infer_request(payload, model, max_instances)
    return caught.value


def test_metadata_describes_digits_tensors():
    cls = resolve_task_class("digits")
    body = model_metadata("digits", ["3"], "relay-pytorch", cls.Instance, cls.Prediction)
    assert body["name"] == "digits" and body["versions"] == ["3"]
    assert body["platform"] == "relay-pytorch"
    assert body["inputs"] == [{"name": "pixels", "datatype": "FP64", "shape": [-1, 64]}]
    assert body["outputs"] == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP64", "shape": [-1, -1]},
    ]


def test_specs_of_the_other_tasks():
    charlm = resolve_task_class("charlm")
    assert specs_by_name(charlm.Instance) == {
        "prompt": ("BYTES", [-1], False),
        "max_new_tokens": ("INT64", [-1], True),
        "temperature": ("FP64", [-1], True),
        "seed": ("INT64", [-1], True),  # `int | None`: the int, optional
    }
    assert specs_by_name(resolve_task_class("regression").Instance) == {
        "features": ("FP64", [-1, -1], False)  # its length depends on the model: not fixed
    }
    # ... and a loaded model fixes it (what GET /v2/models/{name} shows).
    wide = build_task("regression", "debug", {"features": 5}).instance_schema()
    assert specs_by_name(wide) == {"features": ("FP64", [-1, 5], False)}
    from relay.tasks.hf.classification import LabelPrediction

    (label, probabilities) = tensor_specs(LabelPrediction)
    assert (label.datatype, label.as_json) == ("BYTES", False)
    assert (probabilities.datatype, probabilities.as_json) == ("BYTES", True)  # a dict


@pytest.mark.parametrize("nested", [False, True])
def test_digits_request_gives_the_v1_instances(nested):
    task = build_task("digits", "debug")
    images = digits_images(3)
    rows = instances_from_infer_request(digits_request(images, nested), task.Instance, MAX)
    assert task.validate_instances(rows) == task.validate_instances(images)


def test_charlm_request_gives_the_v1_instances_and_defaults_what_is_left_out():
    task = build_task("charlm", "debug")
    v1 = [
        {"prompt": "def main(", "temperature": 0.0, "seed": 1},
        {"prompt": "import ", "temperature": 0.5, "seed": 2},
    ]
    payload = {
        "inputs": [
            {"name": "prompt", "shape": [2], "datatype": "BYTES", "data": ["def main(", "import "]},
            {"name": "temperature", "shape": [2], "datatype": "FP64", "data": [0, 0.5]},
            {"name": "seed", "shape": [2], "datatype": "INT64", "data": [1, 2]},
        ],
        "outputs": [{"name": "text"}],
    }
    rows = instances_from_infer_request(payload, task.Instance, MAX)
    assert all("max_new_tokens" not in row for row in rows)  # omitted: the schema's default
    assert task.validate_instances(rows) == task.validate_instances(v1)


def test_regression_rows_take_the_sent_width_and_the_schema_checks_it():
    task = build_task("regression", "debug")
    features = task.hp.features
    good = [[0.5] * features, [-1.0] * features]
    payload = {
        "inputs": [
            {
                "name": "features",
                "shape": [2, features],
                "datatype": "FP64",
                "data": good,
            }
        ]
    }
    rows = instances_from_infer_request(payload, task.Instance, MAX)
    assert task.validate_instances(rows) == task.validate_instances(good)

    short = {"inputs": [{**payload["inputs"][0], "shape": [1, 3], "data": [1.0, 2.0, 3.0]}]}
    rows = instances_from_infer_request(short, task.Instance, MAX)
    with pytest.raises(ValidationError) as caught:
        task.validate_instances(rows)
    error = validation_error(caught.value, task.Instance)
    assert error.status == 422
    assert [item["loc"] for item in error.detail] == ["inputs.features.0"]


def test_schema_errors_name_the_tensor_element():
    task = build_task("digits", "debug")
    images = digits_images(2)
    images[1][5] = 17  # above the data set's 16
    rows = instances_from_infer_request(digits_request(images), task.Instance, MAX)
    with pytest.raises(ValidationError) as caught:
        task.validate_instances(rows)
    error = validation_error(caught.value, task.Instance)
    assert [item["loc"] for item in error.detail] == ["inputs.pixels.1.5"]
    assert error.detail[0]["type"] == "less_than_equal"


def _digits_case(change):
    payload = digits_request(digits_images(2))
    change(payload)
    return payload


def _set(path, value):
    def change(payload):
        target = payload
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


BAD_DIGITS = {
    "unknown top-level field": (_set(["instances"], []), 422, "instances"),
    "inputs not a list": (_set(["inputs"], {"pixels": []}), 422, "inputs"),
    "inputs empty": (_set(["inputs"], []), 422, "inputs"),
    "id not a string": (_set(["id"], 7), 422, "id"),
    "entry without a name": (_set(["inputs", 0], {"data": []}), 422, "inputs.0"),
    "unknown input": (
        lambda p: p["inputs"].append({**p["inputs"][0], "name": "image"}),
        422,
        "inputs.image",
    ),
    "duplicate input": (lambda p: p["inputs"].append(p["inputs"][0]), 422, "inputs.pixels"),
    "unknown tensor field": (_set(["inputs", 0, "contents"], {}), 422, "inputs.pixels.contents"),
    "wrong datatype": (_set(["inputs", 0, "datatype"], "BYTES"), 422, "inputs.pixels.datatype"),
    "wrong rank": (_set(["inputs", 0, "shape"], [2, 8, 8]), 422, "inputs.pixels.shape"),
    "wrong fixed dim": (_set(["inputs", 0, "shape"], [4, 32]), 422, "inputs.pixels.shape"),
    "shape with a bool": (_set(["inputs", 0, "shape"], [True, 64]), 422, "inputs.pixels.shape"),
    "too few elements": (lambda p: p["inputs"][0]["data"].pop(), 422, "inputs.pixels.data"),
    "data not a list": (_set(["inputs", 0, "data"], "AAAA"), 422, "inputs.pixels.data"),
    "no data": (lambda p: p["inputs"][0].pop("data"), 422, "inputs.pixels.data"),
    "nesting unlike the shape": (
        _set(["inputs", 0, "data"], [[0.0] * 32] * 4),
        422,
        "inputs.pixels.data",
    ),
    "no instances": (
        lambda p: p["inputs"][0].update(shape=[0, 64], data=[]),
        422,
        "inputs.pixels.shape",
    ),
    "nested deeper than the shape": (
        _set(["inputs", 0, "data"], [[0.0] * 64, [0.0] * 63 + [[0.0]]]),
        422,
        "inputs.pixels.data",
    ),
    "string element": (_set(["inputs", 0, "data", 70], "3"), 422, "inputs.pixels.1.6"),
    "bool element": (_set(["inputs", 0, "data", 3], True), 422, "inputs.pixels.0.3"),
    "null element": (_set(["inputs", 0, "data", 3], None), 422, "inputs.pixels.0.3"),
    "NaN element": (_set(["inputs", 0, "data", 64], float("nan")), 422, "inputs.pixels.1.0"),
    "infinite element": (_set(["inputs", 0, "data", 0], float("inf")), 422, "inputs.pixels.0.0"),
    "parameters not an object": (_set(["parameters"], []), 422, "parameters"),
}


@pytest.mark.parametrize("case", list(BAD_DIGITS))
def test_bad_digits_requests_are_refused_naming_the_input(case):
    change, status, loc = BAD_DIGITS[case]
    error = refused(_digits_case(change), resolve_task_class("digits").Instance)
    assert error.status == status
    assert [item["loc"] for item in error.detail] == [loc]


def test_a_body_that_is_no_object_is_refused():
    error = refused([1, 2], resolve_task_class("digits").Instance)
    assert (error.status, error.detail[0]["loc"]) == (422, "body")


def test_more_instances_than_allowed_is_413():
    payload = digits_request(digits_images(3))
    error = refused(payload, resolve_task_class("digits").Instance, max_instances=2)
    assert error.status == 413
    assert error.detail[0]["loc"] == "inputs.pixels.shape"
    assert instances_from_infer_request(payload, resolve_task_class("digits").Instance, 3)


def test_charlm_inputs_must_agree_on_the_batch_and_types():
    charlm = resolve_task_class("charlm").Instance
    prompt = {"name": "prompt", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}
    seed = {"name": "seed", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}
    error = refused({"inputs": [prompt, seed]}, charlm)
    assert (error.status, error.detail[0]["loc"]) == (422, "inputs.seed.shape")

    float_seed = {**seed, "shape": [2], "data": [1, 2.0]}  # 2.0 is no INT64
    assert refused({"inputs": [prompt, float_seed]}, charlm).detail[0]["loc"] == "inputs.seed.1"
    huge_seed = {**seed, "shape": [2], "data": [1, 2**64]}  # beyond INT64
    assert refused({"inputs": [prompt, huge_seed]}, charlm).detail[0]["loc"] == "inputs.seed.1"
    number_prompt = {**prompt, "data": ["a", 5]}
    assert refused({"inputs": [number_prompt]}, charlm).detail[0]["loc"] == "inputs.prompt.1"

    missing = refused({"inputs": [seed]}, charlm)
    assert (missing.detail[0]["loc"], missing.detail[0]["type"]) == ("inputs.prompt", "missing")


class TaggedInstance(InstanceSchema):
    """Fields no built-in task has: a dict (BYTES JSON) and a nullable without a default."""

    tags: dict[str, int]
    weight: float | None = Field()

    @model_validator(mode="after")
    def _weighted_needs_tags(self) -> TaggedInstance:
        if self.weight is not None and not self.tags:
            raise ValueError("a weight needs tags")
        return self


def test_json_inputs_and_nullable_fields():
    assert specs_by_name(TaggedInstance) == {
        "tags": ("BYTES", [-1], False),
        "weight": ("FP64", [-1], True),
    }
    tags = {"name": "tags", "shape": [2], "datatype": "BYTES", "data": ['{"a": 1}', "{}"]}
    rows = instances_from_infer_request({"inputs": [tags]}, TaggedInstance, MAX)
    assert rows == [{"tags": {"a": 1}, "weight": None}, {"tags": {}, "weight": None}]

    bad = {**tags, "data": ['{"a": 1}', "{not json"]}
    error = refused({"inputs": [bad]}, TaggedInstance)
    assert (error.detail[0]["loc"], error.detail[0]["type"]) == ("inputs.tags.1", "json_invalid")

    wrong = {**tags, "data": ['{"a": 1}', '{"b": "x"}']}
    rows = instances_from_infer_request({"inputs": [wrong]}, TaggedInstance, MAX)
    with pytest.raises(ValidationError) as caught:
        TypeAdapter(list[TaggedInstance]).validate_python(rows)  # as validate_instances does
    assert validation_error(caught.value, TaggedInstance).detail[0]["loc"] == "inputs.tags.1.b"

    weight = {"name": "weight", "shape": [2], "datatype": "FP64", "data": [1.0, 2]}
    rows = instances_from_infer_request({"inputs": [tags, weight]}, TaggedInstance, MAX)
    assert [row["weight"] for row in rows] == [1.0, 2]
    with pytest.raises(ValidationError) as caught:
        TypeAdapter(list[TaggedInstance]).validate_python(rows)
    # A whole instance's error (row 1 has a weight but no tags) names the row of every input.
    assert validation_error(caught.value, TaggedInstance).detail[0]["loc"] == "inputs.*.1"


def test_response_has_flat_row_major_tensors():
    torch.manual_seed(0)
    task = build_task("digits", "debug")
    images = digits_images(3)
    predictions = task.predict(task.build_model().eval(), task.validate_instances(images))
    dumps = [p.model_dump() for p in predictions]
    body = infer_response("digits", "3", "req-1", dumps, task.Prediction)
    assert (body["model_name"], body["model_version"], body["id"]) == ("digits", "3", "req-1")
    label, probabilities = body["outputs"]
    assert (label["name"], label["datatype"], label["shape"]) == ("label", "INT64", [3])
    assert label["data"] == [p["label"] for p in dumps]
    assert probabilities["shape"] == [3, 10]
    assert probabilities["data"][10:20] == dumps[1]["probabilities"]  # row 1, row-major
    assert len(probabilities["data"]) == 30
    json.dumps(body, allow_nan=False)  # a valid JSON body


def test_requested_outputs_are_checked_and_honoured():
    cls = resolve_task_class("digits")
    payload = digits_request(digits_images(1))
    assert requested_outputs(payload, cls.Prediction) == ["label", "probabilities"]
    payload["outputs"] = [{"name": "label"}]
    names = requested_outputs(payload, cls.Prediction)
    assert names == ["label"]
    dumps = [{"label": 4, "probabilities": [0.1] * 10}]
    body = infer_response("digits", None, None, dumps, cls.Prediction, names)
    assert [tensor["name"] for tensor in body["outputs"]] == ["label"]
    assert "id" not in body and "model_version" not in body

    for outputs, loc in (
        ([{"name": "logits"}], "outputs.logits"),
        ([{"name": "label"}, {"name": "label"}], "outputs.label"),
        ([{"name": "label", "binary_data": True}], "outputs.label.binary_data"),
        ({"name": "label"}, "outputs"),
    ):
        bad = {**copy.deepcopy(payload), "outputs": outputs}
        with pytest.raises(InferError) as caught:
            requested_outputs(bad, cls.Prediction)
        assert (caught.value.status, caught.value.detail[0]["loc"]) == (422, loc)


def test_dict_outputs_travel_as_json_text():
    from relay.tasks.hf.classification import LabelPrediction

    dumps = [{"label": "def", "probabilities": {"def": 0.75, "class": 0.25}}]
    body = infer_response("clf", "1", None, dumps, LabelPrediction)
    label, probabilities = body["outputs"]
    assert (label["data"], probabilities["shape"]) == (["def"], [1])
    assert json.loads(probabilities["data"][0]) == dumps[0]["probabilities"]


def test_narrower_widths_of_a_datatype_are_accepted():
    """numpy clients send float32 arrays: FP32 for an FP64 input reads the same in JSON."""
    request = digits_request(digits_images(2))
    request["inputs"][0]["datatype"] = "FP32"
    rows = instances_from_infer_request(request, resolve_task_class("digits").Instance, MAX)
    assert rows == [{"pixels": image} for image in digits_images(2)]


@pytest.mark.parametrize(
    "text, kind",
    [("[" * 100_000, "too_deep"), ("[" + "{}," * 100 + "{}]", "too_many_values")],
)
def test_a_json_element_too_deep_or_too_big_is_a_422_naming_it(text, kind):
    """A BYTES-JSON element is parsed as a body is, within a budget: 10⁵ nested `[` were a
    RecursionError (a 500), a row of empty objects ~20× its bytes in memory."""
    tags = {"name": "tags", "shape": [2], "datatype": "BYTES", "data": ["{}", text]}
    error = refused({"inputs": [tags]}, TaggedInstance)
    assert error.status == 422
    assert (error.detail[0]["loc"], error.detail[0]["type"]) == ("inputs.tags.1", kind)
