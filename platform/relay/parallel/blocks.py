"""The model's repeated blocks, and what is done per block: FSDP shards by them, activation
checkpointing recomputes them, torch.compile compiles them. Each change is made in place, so
parameter names (and so checkpoints) stay as the model defines them."""

from __future__ import annotations

import functools

import torch
from torch import nn


def units(model: nn.Module) -> list[nn.Module]:
    """The repeated building blocks FSDP shards by and activation checkpointing recomputes:
    the items of the model's `nn.ModuleList`s (transformer blocks), else its parameterised
    leaf layers (an MLP's linears)."""
    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    if blocks:
        return blocks
    return [
        m
        for m in model.modules()
        if m is not model and not list(m.children()) and any(True for _ in m.parameters())
    ]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each unit's activations in backward instead of storing them.

    The unit's `forward` is replaced in place rather than wrapped in another module, so
    parameter names — and thus checkpoints — do not change; module hooks (FSDP's) stay outside.
    """
    from torch.utils.checkpoint import checkpoint

    for unit in units(model):
        inner = unit.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = forward


def compile_model(model: nn.Module) -> None:
    """torch.compile each block's forward (or the whole forward when there are no blocks).

    Compiling `forward` in place keeps parameter names and keeps DDP/FSDP hooks out of the
    compiled graph."""
    has_blocks = any(isinstance(m, nn.ModuleList) for m in model.modules())
    for target in units(model) if has_blocks else [model]:
        target.forward = torch.compile(target.forward)
