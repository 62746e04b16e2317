"""What a strategy (`parallel.strategy`) decides: how the model is wrapped, how its optimizer
is built, and how full, portable state is taken from it and optimizer state put back. One
module per strategy implements it (ddp.py, zero1.py, fsdp.py); the Engine (engine.py) does
everything else of a step the same way for all of them.

Portable state, whatever the strategy: full (unsharded) weights, and optimizer state keyed by
parameter name — so a checkpoint resumes under another strategy or worker count, and Serve
loads any of them unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from relay.config import ParallelConfig


class Strategy:
    name: str
    # Every rank's model is the whole model, so digests of it compare the ranks.
    holds_full_replica: bool = True

    def wrap(
        self, model: nn.Module, device: torch.device, cfg: ParallelConfig, dtype: torch.dtype | None
    ) -> nn.Module:
        """The model on `device`, wrapped for this strategy (`dtype`: mixed precision's)."""
        raise NotImplementedError

    def optimizer(
        self,
        params: list[nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> torch.optim.Optimizer:
        return optimizer_class(params, **optimizer_kwargs)

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(full weights, optimizer state keyed by parameter name) on rank 0, empty dicts on
        the others; may alias live tensors (the Engine copies). A collective."""
        raise NotImplementedError

    def load_optimizer_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        named: dict[str, Any],
        names: list[str],
    ) -> None:
        """Optimizer state as `full_state` gives it (from any strategy) into `optimizer`."""
        raise NotImplementedError
