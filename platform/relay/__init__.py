"""relay: train, tune and serve PyTorch models on one Ray cluster.

import relay
cfg = relay.load_config("jobs/configs/digits.yaml", ["epochs=3"])
result = relay.train(cfg)   # ray.init() is done for you if nobody has
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relay.version import __version__

__all__ = ["__version__", "load_config", "train"]

if TYPE_CHECKING:
    from relay.config import RunConfig
    from relay.training.trainer import RunResult


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Load and validate a run config (YAML file plus `dotted.key=value` overrides)."""
    from relay.config import load

    return load(path, overrides)


def train(cfg: RunConfig | dict[str, Any], **kwargs: Any) -> RunResult:
    """Train on the current Ray cluster, or an embedded local one; see relay.train.fit."""
    from relay.config import RunConfig, from_dict
    from relay.training.trainer import fit

    return fit(cfg if isinstance(cfg, RunConfig) else from_dict(cfg), **kwargs)
