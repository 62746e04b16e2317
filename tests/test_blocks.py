"""The sharding plan (relay.parallel.blocks): each model family's blocks are named, not guessed
from module types — what fsdp shards by, activation checkpointing recomputes and compile
compiles. Pure torch, no Ray. (The Hugging Face families: tests/test_hf_tasks.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from relay import parallel
from relay.parallel import blocks
from relay.tasks import build_task

pytestmark = pytest.mark.timeout(60)


def test_relay_models_shard_by_the_blocks_their_plan_names():
    charlm = build_task("charlm", "debug").build_model()
    assert parallel.units(charlm) == list(charlm.blocks)
    digits = build_task("digits", "debug").build_model()
    linears = [m for m in digits.net if isinstance(m, nn.Linear)]
    assert len(linears) >= 2 and parallel.units(digits) == linears  # not GELU or Dropout


class _Heads(nn.Module):
    """A model with a stack of blocks and, beside it, a list of output heads: a guess from
    module types takes both for blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.cat([head(x) for head in self.heads], dim=-1)


class _MoreHeads(_Heads):
    pass


def test_a_registered_model_shards_only_its_named_blocks(monkeypatch):
    model = _Heads()
    assert len(parallel.units(model)) == 5  # unregistered: the guess takes the heads too
    monkeypatch.setitem(blocks.BLOCKS, "_Heads", "layers")
    assert parallel.units(model) == list(model.layers)
    assert parallel.units(_MoreHeads()) != [] and blocks.block_path(_MoreHeads()) == "layers"


def test_register_blocks_names_a_user_model(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCKS", dict(blocks.BLOCKS))
    parallel.register_blocks(_Heads, "layers")
    model = _Heads()
    parallel.apply_activation_checkpointing(model)
    # Only the named blocks were changed (their forward now recomputes in backward).
    assert all("forward" in vars(layer) for layer in model.layers)
    assert not any("forward" in vars(head) for head in model.heads)
