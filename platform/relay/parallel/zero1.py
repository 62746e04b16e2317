"""zero1: DDP for the gradients, and `ZeroRedundancyOptimizer`: each rank keeps and steps
1/N of the optimizer state (ZeRO stage 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from relay.parallel.ddp import DDP, unwrap
from relay.parallel.ranks import is_main


class Zero1(DDP):
    name = "zero1"

    def optimizer(
        self,
        params: list[nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> torch.optim.Optimizer:
        # Imported only here: torch.distributed.optim takes ~1.7 s to import on this machine
        # (TorchScript), which every other strategy, and every driver importing relay.parallel,
        # would pay.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self._plain_optimizer = lambda plain_params: optimizer_class(
            plain_params, **optimizer_kwargs
        )
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **optimizer_kwargs)

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its 1/N
        if not is_main():
            return {}, {}
        return unwrap(model).state_dict(), self._optimizer_state(optimizer, names)

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, tied: set[str]
    ) -> dict[str, Any]:
        # config.py refuses checkpoint.format sharded with zero1.
        raise NotImplementedError("ZeroRedundancyOptimizer's state is not a DCP state dict")

    def load_sharded(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        path: Path,
        tied: set[str],
        names: list[str],
    ) -> None:
        """A sharded checkpoint (written under ddp or fsdp) read whole through a plain
        optimizer standing in for ZeroRedundancyOptimizer, whose own state DCP cannot read;
        each rank then keeps its 1/N of the optimizer state as after any full load."""
        from relay.checkpoints import sharded

        plain = unwrap(model)
        stand_in = self._plain_optimizer(list(plain.parameters()))
        state = DDP.sharded_state(self, plain, stand_in, tied)
        sharded.load(state, path)
        plain.load_state_dict(state["model"], strict=False)  # tied aliases follow
        self.load_optimizer_state(model, optimizer, state["optim"], names)
