"""`hf-sequence-classification`: a label per text with a Hugging Face model (bert, gpt2,
llama).

Data: rows of text and label — from files (`data.format: csv | jsonl | parquet`, with
`data.columns` mapping "text" and "label" to the files' columns; labels as names from
`model.labels` or as their indices) or the built-in set: lines of Python's standard library
labelled by the statement they begin, with that keyword removed ("foo(self):" was a def,
"os.path" an import). Texts are cut or padded to block_size tokens. Served as label +
probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, model_validator

from relay.tasks.base import Batch, Columns, InstanceSchema, PredictionSchema, Split, split_rows
from relay.tasks.charlm import default_corpus, read_corpus
from relay.tasks.hf.base import HFSize, HFTask

MAX_TEXT_CHARS = 16_384
#: The built-in set's labels: the keyword each line began with ("#" for comments).
STATEMENTS = ("def", "class", "import", "return", "#")


class ClassifierSize(HFSize):
    labels: tuple[str, ...] = Field(
        STATEMENTS, min_length=2, description="Class names, in label-index order."
    )

    @model_validator(mode="after")
    def _distinct_labels(self) -> ClassifierSize:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must be distinct")
        return self


class TextInstance(InstanceSchema):
    model_config = ConfigDict(json_schema_extra={"examples": [{"text": "main(argv):"}]})
    shorthand = "text"
    text: str = Field(
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="Text to classify; only its first block_size tokens are seen.",
    )


class LabelPrediction(PredictionSchema):
    label: str = Field(description="The most probable class.")
    probabilities: dict[str, float] = Field(description="Each class's probability.")


def statement_lines(text: str) -> tuple[list[str], list[int]]:
    """Lines that begin with one of STATEMENTS, without it; and which one."""
    texts, labels = [], []
    for line in text.splitlines():
        stripped = line.strip()
        for label, keyword in enumerate(STATEMENTS):
            if stripped.startswith(keyword + (" " if keyword != "#" else "")):
                rest = stripped[len(keyword) :].strip()
                if rest:
                    texts.append(rest)
                    labels.append(label)
                break
    return texts, labels


class HFSequenceClassificationTask(HFTask):
    """One label per text; reports loss and accuracy."""

    name = "hf-sequence-classification"
    head = "sequence_classification"
    metric = "val_accuracy"
    mode = "max"
    batch_columns = ("input_ids", "attention_mask", "label")
    Size = ClassifierSize
    Instance = TextInstance
    Prediction = LabelPrediction
    sizes = {
        "debug": {
            "family": "bert",
            "width": 32,
            "layers": 2,
            "heads": 2,
            "context": 64,
            "block_size": 24,
            "corpus_bytes": 200_000,
        },
        "default": {
            "family": "bert",
            "width": 256,
            "layers": 4,
            "heads": 4,
            "context": 256,
            "block_size": 64,
            "corpus_bytes": 4_000_000,
        },
    }

    def head_fields(self) -> dict[str, Any]:
        labels = self.hp.labels
        return {
            "num_labels": len(labels),
            "id2label": dict(enumerate(labels)),
            "label2id": {name: i for i, name in enumerate(labels)},
        }

    def _encode(self, texts: list[str]) -> Columns:
        ids = np.full((len(texts), self.hp.block_size), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(texts), self.hp.block_size), dtype=np.int8)
        for row, encoding in enumerate(self.tokenizer.encode_batch(texts)):
            kept = encoding.ids[: self.hp.block_size]
            ids[row, : len(kept)] = kept
            mask[row, : len(kept)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def _label_indices(self, labels: np.ndarray) -> np.ndarray:
        names = {name: i for i, name in enumerate(self.hp.labels)}
        if labels.dtype.kind in "iu":
            bad = labels[(labels < 0) | (labels >= len(names))]
            if len(bad):
                raise ValueError(f"label {bad[0]} is no index of model.labels ({len(names)})")
            return labels.astype(np.int64)
        unknown = sorted({str(label) for label in labels} - set(names))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} are not in model.labels {list(names)}")
        return np.array([names[str(label)] for label in labels], dtype=np.int64)

    def load_data(self, val_fraction: float, seed: int) -> Split:
        path = default_corpus() if self.data_path is None else self.data_path
        text = read_corpus(Path(path).expanduser(), self.hp.corpus_bytes).decode(
            "utf-8", errors="replace"
        )
        texts, labels = statement_lines(text)
        if len(texts) < 2:
            raise ValueError(f"{path}: no lines that begin with {', '.join(STATEMENTS)}")
        columns = {**self._encode(texts), "label": np.array(labels, dtype=np.int64)}
        return split_rows(columns, val_fraction, seed)

    def preprocess(self, batch: Columns) -> Columns:
        """Rows of "text" and "label" → token ids, attention mask and label index."""
        missing = sorted({"text", "label"} - set(batch))
        if missing and "input_ids" not in batch:
            raise ValueError(f"{self.name} reads 'text' and 'label' columns; missing {missing}")
        if "input_ids" in batch:
            return batch
        texts = [str(text) for text in batch["text"]]
        return {**self._encode(texts), "label": self._label_indices(np.asarray(batch["label"]))}

    def input_columns(self) -> dict[str, torch.dtype]:
        return {"input_ids": torch.long, "attention_mask": torch.long, "label": torch.long}

    def loss_and_stats(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Batch]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.float(), batch["label"])
        n = float(len(batch["label"]))
        stats = {
            "count": torch.tensor(n),
            "loss_sum": loss.detach() * n,
            "correct": (logits.argmax(dim=-1) == batch["label"]).sum().float(),
        }
        return loss, stats

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count}

    @torch.inference_mode()
    def predict(
        self, model: torch.nn.Module, instances: list[TextInstance]
    ) -> list[LabelPrediction]:
        device = next(model.parameters()).device
        encoded = self._encode([instance.text for instance in instances])
        logits = model(
            input_ids=torch.as_tensor(encoded["input_ids"], dtype=torch.long, device=device),
            attention_mask=torch.as_tensor(
                encoded["attention_mask"], dtype=torch.long, device=device
            ),
        ).logits
        probabilities = torch.softmax(logits.float(), dim=-1).cpu().tolist()
        return [
            LabelPrediction(
                label=self.hp.labels[max(range(len(p)), key=p.__getitem__)],
                probabilities=dict(zip(self.hp.labels, p, strict=True)),
            )
            for p in probabilities
        ]
