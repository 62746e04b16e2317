"""What a strategy (`parallel.strategy`) decides: how the model is wrapped, how its optimizer
is built, and how full, portable state is taken from it and optimizer state put back. One
module per strategy implements it (ddp.py, zero1.py, fsdp.py); the Engine (engine.py) does
everything else of a step the same way for all of them.

Portable state, whatever the strategy, in one of two forms — both keyed by parameter name, so a
checkpoint resumes under another strategy or worker count:
- full: whole weights and optimizer state, gathered on rank 0 (`full_state`);
- sharded: each rank's own part, as torch.distributed.checkpoint (DCP) writes and reads it in
  parallel (`sharded_state`, `load_sharded`); DCP reshards on load, so N ranks' shards load
  on M ranks, or whole into a ddp replica.
"""

from __future__ import annotations

from pathlib import Path
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

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Give a model built on the `meta` device its values, after `wrap` (fsdp only)."""
        raise NotImplementedError(f"{self.name} cannot build a model on the meta device")

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

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, tied: set[str]
    ) -> dict[str, Any]:
        """This rank's part of the model and optimizer state, live (not copies), as DCP saves
        and loads it: DTensor shards where the strategy shards, whole tensors where it
        replicates (DCP writes a replicated tensor once). Tied aliases are left out."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        weights = {k: v for k, v in get_model_state_dict(model).items() if k not in tied}
        return {"model": weights, "optim": get_optimizer_state_dict(model, optimizer)}

    def load_sharded(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        path: Path,
        tied: set[str],
        names: list[str],
    ) -> None:
        """Weights and optimizer state from a sharded checkpoint written by any worker count
        and strategy. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from relay.checkpoints import sharded

        state = self.sharded_state(model, optimizer, tied)
        sharded.load(state, path)  # every key of `state` must be in the checkpoint
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False),  # tied aliases follow their parameter
        )
