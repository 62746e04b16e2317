"""`charlm`: a small GPT-style character-level language model trained on text files.

The default corpus is Python's own standard-library source (real text that ships with every
Python, no download). Text is read as UTF-8 bytes, so the vocabulary is the 256 byte values —
every file can be encoded and every model can decode, with no vocabulary to store.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch
from pydantic import ConfigDict, Field

from relay.models import CharTransformer
from relay.tasks.base import (
    Batch,
    Columns,
    InstanceSchema,
    PredictionSchema,
    Split,
    Task,
    TaskSize,
    split_rows,
)
from relay.tasks.lm import generations, next_token_loss, per_token_metrics

VOCAB_SIZE = 256
MAX_PROMPT_CHARS = 4096  # longer prompts are cut to block_size bytes anyway: refuse, don't read
MAX_NEW_TOKENS = 512


class CharLMSize(TaskSize):
    corpus_bytes: int = Field(gt=0, description="Bytes of text read from the corpus (cap).")
    block_size: int = Field(ge=2, description="Context length in characters.")
    d_model: int = Field(ge=8, description="Embedding width.")
    n_layer: int = Field(ge=1, description="Transformer blocks.")
    n_head: int = Field(ge=1, description="Attention heads.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout rate.")


def default_corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(path: Path, limit: int) -> bytes:
    """Concatenate the text files under `path` (sorted, so the corpus is reproducible)."""
    if path.is_file():
        files = [path]
    elif path == default_corpus():
        # Top-level modules only: the stdlib's test suites and vendored data are noise.
        files = sorted(path.glob("*.py"))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    chunks, total = [], 0
    for file in files:
        text = file.read_bytes()
        chunks.append(text)
        total += len(text)
        if total >= limit:
            break
    corpus = b"\n".join(chunks)[:limit]
    if not corpus:
        raise ValueError(f"no text found under {path}")
    return corpus


class CharLMInstance(InstanceSchema):
    """A prompt to continue, byte by byte."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"prompt": "def main(", "max_new_tokens": 32, "seed": 0}]}
    )
    shorthand = "prompt"
    prompt: str = Field(
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="Text to continue; only its last block_size UTF-8 bytes are seen.",
    )
    max_new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS, description="Bytes to generate.")
    temperature: float = Field(
        1.0, ge=0, le=100, description="Sampling temperature; 0 decodes greedily."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Seeds sampling, for a reproducible continuation."
    )


class CharLMPrediction(PredictionSchema):
    text: str = Field(
        description="The continuation (without the prompt), decoded as UTF-8; bytes that are "
        "not valid UTF-8 become U+FFFD."
    )


class CharLMTask(Task):
    """Next-character prediction; reports loss (nats/char) and perplexity."""

    name = "charlm"
    metric = "val_loss"
    mode = "min"
    accepts_data_path = True
    throughput_unit = "tokens"  # predicted characters (bytes)
    throughput_stat = "chars"
    batch_columns = ("tokens",)
    Size = CharLMSize
    Instance = CharLMInstance
    Prediction = CharLMPrediction
    sizes = {
        "debug": {
            "corpus_bytes": 64_000,
            "block_size": 32,
            "d_model": 32,
            "n_layer": 1,
            "n_head": 2,
        },
        "default": {
            "corpus_bytes": 2_000_000,
            "block_size": 128,
            "d_model": 128,
            "n_layer": 4,
            "n_head": 4,
            "dropout": 0.1,
        },
    }

    def build_model(self) -> torch.nn.Module:
        hp = self.hp
        return CharTransformer(
            VOCAB_SIZE, hp.block_size, hp.d_model, hp.n_layer, hp.n_head, hp.dropout
        )

    def load_data(self, val_fraction: float, seed: int) -> Split:
        path = Path(self.data_path).expanduser() if self.data_path else default_corpus()
        corpus = np.frombuffer(read_corpus(path, self.hp.corpus_bytes), dtype=np.uint8)
        window = self.hp.block_size + 1  # inputs plus the next character of each
        n = len(corpus) // window
        if n < 2:
            raise ValueError(f"corpus of {len(corpus)} bytes is shorter than two windows")
        windows = corpus[: n * window].reshape(n, window).copy()
        return split_rows({"tokens": windows}, val_fraction, seed)

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"tokens": torch.long}

    def preprocess(self, batch: Columns) -> Columns:
        """Lines of text (`data.format: text`, column "text") packed into windows of
        block_size + 1 bytes, as `load_data` cuts its corpus; the bytes after the batch's last
        whole window are dropped. Batches that already hold "tokens" pass as they are."""
        if "tokens" in batch:
            return batch
        if "text" not in batch:
            raise ValueError(f"charlm reads a 'text' column (or 'tokens'); got {sorted(batch)}")
        window = self.hp.block_size + 1
        joined = "\n".join(str(line) for line in batch["text"]).encode("utf-8")
        corpus = np.frombuffer(joined, dtype=np.uint8)
        n = len(corpus) // window
        return {"tokens": corpus[: n * window].reshape(n, window).copy()}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        tokens = batch["tokens"]
        return next_token_loss(model(tokens[:, :-1]), tokens, "chars")

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return per_token_metrics(sums, "chars")

    def predict(
        self, model: torch.nn.Module, instances: list[CharLMInstance]
    ) -> list[CharLMPrediction]:
        """One generate() call per group of instances that can share it (lm.generations)."""
        prompts = [
            list(instance.prompt.encode("utf-8"))[-self.hp.block_size :] for instance in instances
        ]
        texts: list[str] = [""] * len(instances)
        for members, tokens, max_new_tokens, temperature, generator in generations(
            instances, prompts
        ):
            with torch.inference_mode():
                out = model.generate(tokens, max_new_tokens, temperature, generator=generator)
            for i, row in zip(members, out[:, tokens.shape[1] :].tolist(), strict=True):
                texts[i] = bytes(row).decode("utf-8", errors="replace")
        return [CharLMPrediction(text=text) for text in texts]
