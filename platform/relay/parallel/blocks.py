"""The model's repeated blocks, and what is done per block: FSDP shards by them, activation
checkpointing recomputes them, torch.compile compiles them. Each change is made in place, so
parameter names (and so checkpoints) stay as the model defines them."""

from __future__ import annotations

import functools

import torch
from torch import nn

#: The sharding plan of each model family relay trains: where its repeated blocks are, as a
#: dotted path to the container (`nn.ModuleList` / `nn.Sequential`) that holds them — what
#: torchtitan's `parallelize_*` functions name per model (`model.layers`). The blocks are the
#: container's items that hold parameters (an MLP's linears, not its activations). Keyed by
#: class name, so the Hugging Face classes are named without importing transformers here; a
#: subclass follows its base's entry.
BLOCKS: dict[str, str] = {
    "MLP": "net",  # relay.models: digits, regression
    "CharTransformer": "blocks",  # relay.models: charlm
    "GPT2LMHeadModel": "transformer.h",
    "GPT2ForSequenceClassification": "transformer.h",
    "LlamaForCausalLM": "model.layers",
    "LlamaForSequenceClassification": "model.layers",
    "BertForSequenceClassification": "bert.encoder.layer",
}


def register_blocks(model_class: type[nn.Module] | str, path: str) -> None:
    """Name where a model class keeps its repeated blocks (see BLOCKS): a user task calls this
    for its own model, next to the model, so fsdp shards exactly those."""
    name = model_class if isinstance(model_class, str) else model_class.__name__
    BLOCKS[name] = path


def block_path(model: nn.Module) -> str | None:
    """The path of `model`'s blocks in the plan, or None for a model the plan does not name."""
    for cls in type(model).__mro__:
        if cls.__name__ in BLOCKS:
            return BLOCKS[cls.__name__]
    return None


def units(model: nn.Module) -> list[nn.Module]:
    """The repeated building blocks FSDP shards by, activation checkpointing recomputes and
    compile compiles: those the plan names for the model's family (BLOCKS), else a guess for
    models nobody registered — the items of its `nn.ModuleList`s, else its parameterised leaf
    layers."""
    path = block_path(model)
    if path is not None:
        container = model.get_submodule(path)
        return [m for m in container if any(True for _ in m.parameters())]
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
    """torch.compile each block's forward when the blocks are a stack the model loops over (an
    `nn.ModuleList`: transformer blocks), else the whole forward (an MLP's layers are too small
    to compile one by one).

    Compiling `forward` in place keeps parameter names and keeps DDP/FSDP hooks out of the
    compiled graph."""
    path = block_path(model)
    if path is not None:
        stacked = isinstance(model.get_submodule(path), nn.ModuleList)
    else:
        stacked = any(isinstance(m, nn.ModuleList) for m in model.modules())
    for target in units(model) if stacked else [model]:
        target.forward = torch.compile(target.forward)
