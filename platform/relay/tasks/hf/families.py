"""Model families: relay's shape fields → each `transformers` config, and the model classes.

A config gives the shape in family-neutral fields (width, layers, heads, context, ffn_width) so
that one size preset fits every family; any other field of the family's config class (e.g.
gpt2's `activation_function`, llama's `rope_theta`) passes through as it is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

SHAPE_FIELDS = ("width", "layers", "heads", "context", "ffn_width")


@dataclass(frozen=True)
class Family:
    config_class: str
    causal_lm: str | None  # None: the family has no causal-LM head relay trains
    sequence_classification: str
    # relay's shape field → the config's own name for it
    names: dict[str, str]

    def config_type(self) -> type:
        return _transformers(self.config_class)

    def model_class(self, head: str) -> type:
        name = getattr(self, head)
        if name is None:
            raise ValueError(f"this family has no {head.replace('_', '-')} model")
        return _transformers(name)


FAMILIES = {
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        "GPT2ForSequenceClassification",
        {
            "width": "n_embd",
            "layers": "n_layer",
            "heads": "n_head",
            "context": "n_positions",
            "ffn_width": "n_inner",
        },
    ),
    "llama": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        "LlamaForSequenceClassification",
        {
            "width": "hidden_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "context": "max_position_embeddings",
            "ffn_width": "intermediate_size",
        },
    ),
    "bert": Family(
        "BertConfig",
        None,
        "BertForSequenceClassification",
        {
            "width": "hidden_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "context": "max_position_embeddings",
            "ffn_width": "intermediate_size",
        },
    ),
}


def _transformers(name: str) -> type:
    return getattr(importlib.import_module("transformers"), name)


def check_extra_fields(family: str, extra: dict[str, Any]) -> None:
    """Raise ValueError("model.FIELD: ...") for a field the family's config lacks, or one
    relay sets itself."""
    spec = FAMILIES[family]
    own = {name: shape for shape, name in spec.names.items()}
    known = spec.config_type()().to_dict()
    for field in extra:
        if field in own:
            raise ValueError(f"model.{field}: set model.{own[field]} instead ({family}'s {field})")
        if field == "vocab_size":
            raise ValueError("model.vocab_size: comes from the tokenizer (model.tokenizer)")
        if field not in known:
            raise ValueError(f"model.{field}: not a field of {spec.config_class}")


def build_config(family: str, shape: dict[str, int], extra: dict[str, Any], **fixed: Any):
    """The family's config with relay's shape, the pass-through fields and `fixed` (vocabulary
    size, special token ids, labels) set."""
    spec = FAMILIES[family]
    fields = {spec.names[k]: v for k, v in shape.items() if v is not None}
    if family == "llama":
        fields["num_key_value_heads"] = shape["heads"]  # plain multi-head attention
    if "ffn_width" in shape and shape["ffn_width"] is None and family != "gpt2":
        fields[spec.names["ffn_width"]] = 4 * shape["width"]
    return spec.config_type()(**{**fields, **extra, **fixed})
