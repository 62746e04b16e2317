"""Task registry: built-in names → task classes; anything else is imported as "module:Class".

A name the user gives (their run config, the command line) is imported as given, from the
current directory too, like `python -m`. A name a file gives — a checkpoint's meta.json — is
code chosen by whoever wrote the file: `check_allowed` lets it through only if it is built in
or the user allowed that very name (`--allow-task`; callers add the task the trusted storage
root records for that checkpoint's run or model version), before anything is imported.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

from relay.tasks.base import Split, Task, TaskSize, split_rows

BUILTIN = {
    "regression": "relay.tasks.regression:RegressionTask",
    "digits": "relay.tasks.digits:DigitsTask",
    "charlm": "relay.tasks.charlm:CharLMTask",
    # Hugging Face Transformers models (the `hf` extra)
    "hf-causal-lm": "relay.tasks.hf.causal_lm:HFCausalLMTask",
    "hf-sequence-classification": "relay.tasks.hf.classification:HFSequenceClassificationTask",
}

__all__ = [
    "BUILTIN",
    "Split",
    "Task",
    "TaskSize",
    "UntrustedTask",
    "build_task",
    "check_allowed",
    "check_task_spec",
    "resolve_task_class",
    "split_rows",
]

# "package.module:Class": dotted Python identifiers, a colon, an identifier.
_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


class UntrustedTask(ValueError):
    """A file names a task that is neither built in nor allowed by the user."""


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
    """A built-in name, or "package.module:Class" naming a Task subclass. For names the user
    gives; one read from a file passes `check_allowed` first."""
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


def check_task_spec(spec: str) -> str:
    """`spec` if it reads "package.module:Class" (what `--allow-task` takes), else ValueError."""
    if not _SPEC.fullmatch(spec):
        raise ValueError(f"{spec!r} is not a task as package.module:Class")
    return spec


def check_allowed(name: Any, source: str, allow: Iterable[str] = ()) -> str:
    """`name`, read from the file `source`, if relay may import it: a built-in, or a name in
    `allow` (the user's own choice). Else UntrustedTask, naming the file, the task and the
    flag to pass; nothing is imported either way."""
    if not isinstance(name, str):
        raise UntrustedTask(f"{source}: config.task is {name!r}, not a task name")
    if name in BUILTIN or name in set(allow):
        return name
    if not _SPEC.fullmatch(name):  # not even importable: nothing to suggest allowing
        raise UntrustedTask(f"{source} names task {name!r}, which is not a task relay knows")
    raise UntrustedTask(
        f"{source} names task {name!r}, which is not built in; relay imports a task a "
        f"checkpoint names only if you allow it: pass --allow-task {name} "
        f"(Python: allow_task=[{name!r}]) if you trust that code"
    )
