"""ddp: a full replica of the model on every rank; gradients all-reduced by
DistributedDataParallel. On one rank, what every strategy comes down to: the bare module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relay.checkpoints import checkpoint
from relay.config import ParallelConfig
from relay.parallel.ranks import distributed, is_main
from relay.parallel.strategy import Strategy


class DDP(Strategy):
    name = "ddp"

    def wrap(
        self, model: nn.Module, device: torch.device, cfg: ParallelConfig, dtype: torch.dtype | None
    ) -> nn.Module:
        """The model on this device, in DistributedDataParallel when there is more than one
        rank.

        This is what `ray.train.torch.prepare_model(model, parallel_strategy_kwargs=...)` did
        (Ray 2.60, ray/train/v2/torch/train_loop_utils.py), written out so that no Ray is
        needed and a torchrun process builds the identical wrapper: move to the device (which
        `set_device` made current on GPU); wrap only at world size > 1 (one process trains the
        bare module, no DDP hooks); on GPU pin DDP to this rank's device (`device_ids`,
        `output_device`). Nothing else of prepare_model applies (its FSDP1 branch: fsdp is
        FSDP2, in fsdp.py)."""
        model = model.to(device)
        if not distributed():
            return model
        # Gradients as views into DDP's communication buckets: no copy in or out of them.
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True}
        if device.type == "cuda":
            kwargs.update(device_ids=[device], output_device=device)
        # DDP broadcasts rank 0's parameters on construction: every replica starts equal.
        return DistributedDataParallel(model, **kwargs)

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if not is_main():
            return {}, {}
        return unwrap(model).state_dict(), self._optimizer_state(optimizer, names)

    def _optimizer_state(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict:
        return checkpoint.optimizer_state_by_name(optimizer.state_dict(), names)

    def load_optimizer_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        named: dict[str, Any],
        names: list[str],
    ) -> None:
        optimizer.load_state_dict(checkpoint.optimizer_state_by_index(named, names))


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside whatever wrapper a strategy put around it (FSDP2 shards in
    place, so an FSDP model is its own plain module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
