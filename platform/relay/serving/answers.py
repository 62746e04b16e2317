"""What a replica's clients see of a request and of a model: a body parsed as JSON under its
limits, an answer encoded as JSON (or a 422 for a non-finite prediction), a model's reference
and version as shown (never where its checkpoint lies)."""

import json
import math
import os
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from relay.serving import json_limits
from relay.serving.model_table import LoadedModel
from relay.serving.web import error


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
