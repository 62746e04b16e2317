"""`hf-causal-lm`: next-token prediction with a Hugging Face decoder (gpt2, llama).

Data: text — the built-in corpus (Python's standard-library source, as charlm reads it), a
directory or file of text (`data.path`), or text files read by Ray Data (`data.format: text`)
— tokenized and cut into windows of block_size + 1 tokens. Served as text generation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import Field, ValidationInfo, model_validator

from relay.tasks.base import Batch, Columns, PredictionSchema, Split, split_rows
from relay.tasks.charlm import MAX_NEW_TOKENS, CharLMInstance, default_corpus, read_corpus
from relay.tasks.hf.base import HFTask
from relay.tasks.lm import generations, next_token_loss, per_token_metrics

MAX_PROMPT_CHARS = 8192


class PromptInstance(CharLMInstance):
    """A prompt to continue, token by token (temperature and seed as for charlm)."""

    prompt: str = Field(
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="Text to continue; only its last tokens that leave room for the new ones "
        "(context - max_new_tokens) are seen.",
    )
    max_new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS, description="Tokens to generate.")

    @model_validator(mode="after")
    def _fits_the_context(self, info: ValidationInfo) -> PromptInstance:
        task = (info.context or {}).get("task")
        if task is not None and self.max_new_tokens >= task.context:
            raise ValueError(
                f"max_new_tokens must be below the model's context ({task.context} tokens)"
            )
        return self


class TextPrediction(PredictionSchema):
    text: str = Field(description="The continuation, without the prompt; ends at end-of-text.")


class HFCausalLMTask(HFTask):
    """Next-token prediction; reports loss (nats/token) and perplexity."""

    name = "hf-causal-lm"
    head = "causal_lm"
    metric = "val_loss"
    mode = "min"
    throughput_unit = "tokens"
    throughput_stat = "tokens"
    batch_columns = ("tokens",)
    Instance = PromptInstance
    Prediction = TextPrediction
    sizes = {
        "debug": {
            "family": "gpt2",
            "width": 32,
            "layers": 2,
            "heads": 2,
            "context": 128,  # room for a prompt and the default 64 new tokens
            "block_size": 32,
            "corpus_bytes": 48_000,
        },
        "default": {
            "family": "gpt2",
            "width": 256,
            "layers": 4,
            "heads": 4,
            "context": 256,
            "block_size": 128,
            "corpus_bytes": 2_000_000,
        },
    }

    def _windows(self, text: str) -> np.ndarray:
        ids = np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        window = self.hp.block_size + 1  # inputs plus the next token of each
        n = len(ids) // window
        return ids[: n * window].reshape(n, window)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        path = Path(self.data_path).expanduser() if self.data_path else default_corpus()
        text = read_corpus(path, self.hp.corpus_bytes).decode("utf-8", errors="replace")
        windows = self._windows(text)
        if len(windows) < 2:
            raise ValueError(f"{path}: too little text for two windows of {self.hp.block_size}")
        return split_rows({"tokens": windows}, val_fraction, seed)

    def preprocess(self, batch: Columns) -> Columns:
        """Lines of text (column "text") tokenized and packed into windows; the tokens after
        the batch's last whole window are dropped."""
        if "tokens" in batch:
            return batch
        if "text" not in batch:
            raise ValueError(f"{self.name} reads a 'text' column; got {sorted(batch)}")
        return {"tokens": self._windows("\n".join(str(line) for line in batch["text"]))}

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"tokens": torch.long}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        tokens = batch["tokens"]
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        return next_token_loss(logits, tokens, "tokens")

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return per_token_metrics(sums, "tokens")

    def predict(
        self, model: torch.nn.Module, instances: list[PromptInstance]
    ) -> list[TextPrediction]:
        """One generation per group of instances that can share it (lm.generations)."""
        prompts = [self._prompt_ids(instance) for instance in instances]
        texts = [""] * len(instances)
        for members, tokens, max_new_tokens, temperature, generator in generations(
            instances, prompts
        ):
            rows = self._generate(model, tokens, max_new_tokens, temperature, generator)
            for i, row in zip(members, rows, strict=True):
                texts[i] = self.tokenizer.decode(row, skip_special_tokens=True)
        return [TextPrediction(text=text) for text in texts]

    def _prompt_ids(self, instance: PromptInstance) -> list[int]:
        room = self.context - instance.max_new_tokens
        return self.tokenizer.encode(instance.prompt).ids[-room:]

    @torch.inference_mode()
    def _generate(
        self,
        model: torch.nn.Module,
        prompts: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator | None,
    ) -> list[list[int]]:
        """Sampled (or greedy) continuations, each cut at its first end-of-text; the model's
        key/value cache carries the context, so each new token costs one position."""
        device = next(model.parameters()).device
        step, cache = prompts.to(device), None
        new: list[torch.Tensor] = []
        ended = torch.zeros(len(prompts), dtype=torch.bool)
        for _ in range(max_new_tokens):
            out = model(input_ids=step, cache=cache, use_cache=True)
            cache = out.cache
            logits = out.logits[:, -1, :].float().cpu()
            if temperature == 0.0:
                token = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            new.append(token)
            ended |= token == self.end_id
            if bool(ended.all()):
                break
            step = token[:, None].to(device)
        rows = torch.stack(new, dim=1).tolist()
        return [row[: row.index(self.end_id)] if self.end_id in row else row for row in rows]
