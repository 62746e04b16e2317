"""fsdp: FSDP2 `fully_shard` per block, then the root — parameters, gradients and optimizer
state all sharded across the ranks (ZeRO-3; `reshard_after_forward: false` ≈ ZeRO-2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from relay.config import ParallelConfig
from relay.parallel.blocks import units
from relay.parallel.strategy import Strategy


class FSDP(Strategy):
    name = "fsdp"
    holds_full_replica = False

    def wrap(
        self, model: nn.Module, device: torch.device, cfg: ParallelConfig, dtype: torch.dtype | None
    ) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model.to(device)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for unit in units(model):
            fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
        # The root holds what no unit does (embeddings, tied head, final norm); it is gathered
        # for the whole step anyway, so it is not resharded after forward.
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        return model

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # Gathered to rank 0's CPU (the others get empty dicts).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        return weights, get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        named: dict[str, Any],
        names: list[str],
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, named, options=options)
