"""zero1: DDP for the gradients, and `ZeroRedundancyOptimizer`: each rank keeps and steps
1/N of the optimizer state (ZeRO stage 1)."""

from __future__ import annotations

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

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **optimizer_kwargs)

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its 1/N
        if not is_main():
            return {}, {}
        return unwrap(model).state_dict(), self._optimizer_state(optimizer, names)
