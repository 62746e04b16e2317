"""Hugging Face models trained by relay on the shared local Ray cluster: ddp, then resumed
under fsdp; the checkpoint loaded by transformers; a classifier from labelled files under fsdp,
starting from a local pretrained directory. (Serving: test_serve.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.tasks.hf import tokenizer
from relay.tasks.hf.classification import STATEMENTS, statement_lines

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run_config(task: str, storage, **fields):
    return from_dict(
        {
            "name": f"test-{task}",
            "task": task,
            "size": "debug",
            "batch_size": 32,
            "optim": {"lr": 0.003},
            "storage": str(storage),
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            **fields,
        }
    )


def test_causal_lm_trains_ddp_resumes_under_fsdp_and_transformers_loads_it(ray_cluster, tmp_path):
    ddp = relay.train(run_config("hf-causal-lm", tmp_path, epochs=1), out=None, register=False)
    assert ddp.replicas_in_sync is True
    # Resumed under fsdp with bf16 and activation checkpointing: the same weights and optimizer
    # state, resharded across the 2 ranks, go on from epoch 2.
    parallel = {"strategy": "fsdp", "mixed_precision": "bf16", "activation_checkpointing": True}
    fsdp = relay.train(
        run_config("hf-causal-lm", tmp_path, epochs=2, parallel=parallel),
        out=None,
        run_id=ddp.run_id,
        register=False,
    )
    assert [e["epoch"] for e in fsdp.history] == [1, 2]
    losses = [e["val_loss"] for e in fsdp.history]
    assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses), losses
    last = checkpoint.read_meta(fsdp.last_checkpoint)
    assert (last["epoch"], last["strategy"], last["workers"]) == (2, "fsdp", 2)

    # The checkpoint is a Hugging Face model directory: transformers loads model and tokenizer
    # and computes what relay's own loading does.
    _, model = checkpoint.load_model(fsdp.checkpoint)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(fsdp.checkpoint).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(fsdp.checkpoint)
    ids = torch.tensor([hf_tokenizer("def main(argv):")["input_ids"]])
    with torch.inference_mode():
        assert torch.allclose(
            hf_model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5
        )


def test_classifier_learns_labelled_files_under_fsdp_from_a_pretrained_directory(
    ray_cluster, tmp_path
):
    """Rows of text and a string label in JSON Lines, mapped by data.columns; the model starts
    from a directory written with save_pretrained (with its own trained tokenizer)."""
    from relay.tasks.charlm import default_corpus, read_corpus

    text = read_corpus(default_corpus(), 300_000).decode("utf-8", errors="replace")
    texts, labels = statement_lines(text)
    files = tmp_path / "rows"
    files.mkdir()
    for part in range(3):
        with open(files / f"part-{part}.jsonl", "w") as out:
            for t, label in list(zip(texts, labels, strict=True))[part::3]:
                out.write(json.dumps({"sentence": t, "kind": STATEMENTS[label]}) + "\n")

    pretrained = tmp_path / "pretrained"
    tok = tokenizer.train(texts, 400)
    tokenizer.save(tok, pretrained)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        vocab_size=tok.get_vocab_size(),
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(pretrained)

    cfg = run_config(
        "hf-sequence-classification",
        tmp_path,
        epochs=2,
        model={"pretrained": str(pretrained)},
        data={
            "format": "jsonl",
            "path": str(files),
            "columns": {"text": "sentence", "label": "kind"},
            "split_key": "sentence",
        },
        parallel={"strategy": "fsdp"},
    )
    result = relay.train(cfg, out=None, register=False)
    accuracy = [e["val_accuracy"] for e in result.history]
    # Five classes: chance is about 0.2 (the largest class is under 0.4 of the rows).
    assert max(accuracy) > 0.6, accuracy
    served_task, model = checkpoint.load_model(result.checkpoint)
    assert served_task.tokenizer.get_vocab_size() == tok.get_vocab_size()
    (prediction,) = served_task.predict(model, served_task.validate_instances(["os.path"]))
    assert prediction.label in STATEMENTS
