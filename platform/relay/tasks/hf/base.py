"""What the Hugging Face tasks share: the size fields, the tokenizer, building or loading the
model, and the files that make a checkpoint a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, Field

from relay.tasks.base import Task, TaskSize
from relay.tasks.hf import families, tokenizer

Family = Literal["gpt2", "llama", "bert"]


class HFSize(TaskSize):
    """Shape fields common to every family; any other field of the family's config class
    passes through (e.g. `activation_function: gelu` for gpt2)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    family: Family = Field(description="Model family: gpt2, llama or bert.")
    width: int = Field(ge=8, description="Hidden size (gpt2: n_embd).")
    layers: int = Field(ge=1, description="Transformer blocks.")
    heads: int = Field(ge=1, description="Attention heads; must divide width.")
    context: int = Field(ge=2, description="Most positions the model takes (n_positions).")
    ffn_width: int | None = Field(None, ge=1, description="Feed-forward width (4 x width).")
    block_size: int = Field(ge=2, description="Tokens per training sequence (<= context).")
    corpus_bytes: int = Field(
        gt=0, description="Bytes of text read from the built-in corpus or data.path (cap)."
    )
    tokenizer: str = Field(
        tokenizer.BYTES,
        description="'bytes' (one token per byte) or a directory written by `relay tokenizer`.",
    )
    pretrained: str | None = Field(
        None,
        description="A local directory saved with save_pretrained to start from; its "
        "config.json then sets the family and shape.",
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.pretrained: cannot read {path}: {exc}") from None


def _tokenizer_source(hp: HFSize) -> str:
    """The configured tokenizer; with none ("bytes"), a pretrained directory's own."""
    pretrained = Path(hp.pretrained or ".").expanduser()
    if hp.tokenizer == tokenizer.BYTES and hp.pretrained:
        return str(pretrained) if tokenizer.has_tokenizer(pretrained) else tokenizer.BYTES
    return hp.tokenizer


class HFTask(Task):
    """Base of the Hugging Face tasks; `head` names the model class of the family."""

    head: ClassVar[str]  # "causal_lm" or "sequence_classification"
    # `from_pretrained` loads weights as it builds, which the meta device cannot hold; and
    # transformers' own init is not relay's per-module one, so meta init would not help.
    builds_on_meta: ClassVar[bool] = False
    accepts_data_path = True
    Size = HFSize

    @classmethod
    def check_size(cls, size: str, overrides: dict[str, Any]) -> TaskSize:
        hp = super().check_size(size, overrides)
        if hp.pretrained is None and hp.width % hp.heads:
            raise ValueError(f"model.heads: {hp.heads} does not divide model.width ({hp.width})")
        if hp.pretrained is None and hp.block_size > hp.context:
            raise ValueError(
                f"model.block_size: {hp.block_size} exceeds model.context ({hp.context})"
            )
        if hp.pretrained is None:
            if getattr(families.FAMILIES[hp.family], cls.head) is None:
                raise ValueError(f"model.family: {hp.family} has no {cls.name} model")
            families.check_extra_fields(hp.family, hp.model_extra or {})
        else:
            config = Path(hp.pretrained).expanduser() / "config.json"
            if not config.is_file():
                raise ValueError(f"model.pretrained: no config.json in {hp.pretrained}")
            vocab = _read_json(config).get("vocab_size", 0)
            tokens = tokenizer.load(_tokenizer_source(hp)).get_vocab_size()
            if tokens > vocab:
                raise ValueError(
                    f"model.tokenizer: {tokens} tokens, more than the pretrained model's "
                    f"vocab_size ({vocab})"
                )
        return hp

    def __init__(self, size="default", model=None, data_path=None) -> None:
        super().__init__(size, model, data_path)
        self._saved: Path | None = None  # a checkpoint's own config (load_assets)
        self._context: int | None = None  # read from a config file once, not per request
        self.tokenizer = tokenizer.load(_tokenizer_source(self.hp))
        self.end_id, self.pad_id = tokenizer.special_ids(self.tokenizer)

    @property
    def context(self) -> int:
        """The most positions the model takes."""
        if self.hp.pretrained is None and self._saved is None:
            return self.hp.context
        if self._context is None:
            config = self.model_config()
            self._context = int(
                getattr(config, "n_positions", None) or config.max_position_embeddings
            )
        return self._context

    def head_fields(self) -> dict[str, Any]:
        """Config fields the task's head needs (labels for a classifier)."""
        return {}

    def model_config(self):
        """The `transformers` config of the model this task trains."""
        from transformers import AutoConfig

        if self._saved is not None:
            return AutoConfig.from_pretrained(self._saved)
        fixed = {
            "pad_token_id": self.pad_id,
            "eos_token_id": self.end_id,
            "bos_token_id": self.end_id,
            **self.head_fields(),
        }
        if self.hp.pretrained is not None:
            return AutoConfig.from_pretrained(Path(self.hp.pretrained).expanduser(), **fixed)
        shape = {name: getattr(self.hp, name) for name in families.SHAPE_FIELDS}
        return families.build_config(
            self.hp.family,
            shape,
            dict(self.hp.model_extra or {}),
            vocab_size=self.tokenizer.get_vocab_size(),
            **fixed,
        )

    def build_model(self) -> torch.nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()  # no load reports on every worker
        transformers.utils.logging.disable_progress_bar()
        config = self.model_config()
        auto = {
            "causal_lm": transformers.AutoModelForCausalLM,
            "sequence_classification": transformers.AutoModelForSequenceClassification,
        }[self.head]
        if self._saved is not None:  # weights follow from the checkpoint (load_weights)
            return auto.from_config(config)
        if self.hp.pretrained is not None:
            return auto.from_pretrained(Path(self.hp.pretrained).expanduser(), config=config)
        model_class = families.FAMILIES[self.hp.family].model_class(self.head)
        return model_class(config)

    def save_assets(self, directory: Path) -> None:
        """config.json and the tokenizer beside the weights: the checkpoint is then a model
        directory `transformers.AutoModel*.from_pretrained` loads."""
        config = self.model_config()
        family = families.FAMILIES.get(config.model_type)
        if family is not None and getattr(family, self.head) is not None:
            # This task's head (a classifier fine-tuned from a causal LM is no longer one).
            config.architectures = [getattr(family, self.head)]
        config.save_pretrained(str(directory))
        tokenizer.save(self.tokenizer, directory)

    def load_assets(self, directory: Path) -> None:
        """A task rebuilt from a checkpoint takes the config and tokenizer saved in it, so the
        tokenizer or pretrained directory it was trained from may be gone."""
        if (Path(directory) / "config.json").is_file():
            self._saved = Path(directory)
            self._context = None
        if tokenizer.has_tokenizer(directory):
            self.tokenizer = tokenizer.load(directory)
            self.end_id, self.pad_id = tokenizer.special_ids(self.tokenizer)
