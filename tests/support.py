"""Helpers the tests share (conftest.py holds the fixtures)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: our venv first, a cluster of their own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_ADDRESS"] = "local"
    env.update(extra)
    return env


def first_batch(task, columns, n: int):
    """The first `n` rows of numpy columns as the torch batch the loop would feed the task."""
    import torch

    dtypes = task.input_columns()
    batch = {}
    for name, array in columns.items():
        tensor = torch.as_tensor(array[:n])
        batch[name] = tensor.to(dtypes.get(name, tensor.dtype))
    return batch
