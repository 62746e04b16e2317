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

        if not on_meta(model):  # a meta model is materialised after sharding (`materialise`)
            model.to(device)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for unit in units(model):
            fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
        # The root holds what no unit does (embeddings, tied head, final norm); it is gathered
        # for the whole step anyway, so it is not resharded after forward.
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        return model

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Give a model built on the `meta` device, and sharded, its values — this rank's
        shards only. Storage for the shards is allocated (`to_empty`), then each module that
        owns parameters is initialised alone: its parameters stand in whole on the CPU for the
        module's own seeded init (models.init_module), this rank's shard of each is copied in,
        and the whole ones are dropped before the next module. The rank never holds more than
        its shards and one module whole, and gets exactly what the whole model built normally
        would give it."""
        from torch.distributed.tensor import distribute_tensor

        from relay import models

        model.to_empty(device=device)
        for name, module in models.modules_to_init(model):
            sharded = dict(module.named_parameters(recurse=False))
            for key, param in sharded.items():  # whole stand-ins, registered in their place
                whole = torch.empty(param.shape, dtype=param.dtype)
                setattr(module, key, nn.Parameter(whole, requires_grad=False))
            try:
                models.init_module(model, name, module)
                wholes = {key: getattr(module, key).detach() for key in sharded}
            finally:
                for key, param in sharded.items():
                    setattr(module, key, param)
            with torch.no_grad():
                for key, param in sharded.items():
                    # Each rank slices its own shard out of the same whole (no communication).
                    mine = distribute_tensor(
                        wholes[key].to(device), param.device_mesh, param.placements,
                        src_data_rank=None,
                    )  # fmt: skip
                    param.to_local().copy_(mine.to_local())

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


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())
