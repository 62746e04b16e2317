"""Task registry: built-in names → task classes; anything else is imported as "module:Class"."""

from __future__ import annotations

import importlib
import os
import sys

from relay.tasks.base import Split, Task, TaskSize, split_rows

BUILTIN = {
    "regression": "relay.tasks.regression:RegressionTask",
    "digits": "relay.tasks.digits:DigitsTask",
    "charlm": "relay.tasks.charlm:CharLMTask",
    # Hugging Face Transformers models (the `hf` extra)
    "hf-causal-lm": "relay.tasks.hf.causal_lm:HFCausalLMTask",
    "hf-sequence-classification": "relay.tasks.hf.classification:HFSequenceClassificationTask",
}

__all__ = ["BUILTIN", "Split", "Task", "TaskSize", "build_task", "resolve_task_class", "split_rows"]


def _import(spec: str) -> type:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import task module {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def resolve_task_class(name: str) -> type[Task]:
    """A built-in name, or "package.module:Class" naming a Task subclass."""
    if name in BUILTIN:
        return _import(BUILTIN[name])
    if ":" not in name:
        choices = ", ".join(sorted(BUILTIN))
        raise ValueError(
            f"unknown task {name!r}: use a built-in ({choices}) or 'package.module:Class'"
        )
    # Like `python -m`, user tasks resolve from the current directory (the console script's own
    # sys.path lacks it); the embedded cluster's workers get the same path (cluster.py).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cls = _import(name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"{name!r} is not a subclass of relay.tasks.Task")
    if "debug" not in cls.sizes:
        raise ValueError(f"{name!r} has no 'debug' size preset")
    return cls


def build_task(name: str, size: str, model: dict | None = None, data_path: str | None = None):
    return resolve_task_class(name)(size=size, model=model, data_path=data_path)
