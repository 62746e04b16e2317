"""`charlm`: a small GPT-style character-level language model trained on text files.

The default corpus is Python's own standard-library source (real text that ships with every
Python, no download). Text is read as UTF-8 bytes, so the vocabulary is the 256 byte values —
every file can be encoded and every model can decode, with no vocabulary to store.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from relay.models import CharTransformer
from relay.tasks.base import Batch, Split, Task, TaskSize, split_rows

VOCAB_SIZE = 256


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


class CharLMTask(Task):
    """Next-character prediction; reports loss (nats/char) and perplexity."""

    name = "charlm"
    metric = "val_loss"
    mode = "min"
    accepts_data_path = True
    Size = CharLMSize
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

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        n = len(tokens)
        chars = float(tokens[:, 1:].numel())
        stats = {
            "count": torch.tensor(float(n)),
            "chars": torch.tensor(chars),
            "loss_sum": loss.detach() * chars,
        }
        return loss, stats

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["chars"], 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
