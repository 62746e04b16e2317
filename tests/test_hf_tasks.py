"""The Hugging Face tasks in plain torch (no Ray): tokenizers, configs, layer lists, local
pretrained directories, the Hugging Face layout of a checkpoint, predictions."""

from __future__ import annotations

import json

import pytest
import torch

from relay import parallel
from relay.checkpoints import checkpoint
from relay.cli import main as relay_main
from relay.config import ConfigError, from_dict
from relay.tasks import build_task
from relay.tasks.hf import tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)

TEXT = "def naïve(x):\n    return x ** 2  # ½ · λ → ok\n" * 40


def test_byte_tokenizer_round_trips_any_text_one_token_per_byte():
    tok = tokenizer.byte_tokenizer()
    ids = tok.encode(TEXT).ids
    assert len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.get_vocab_size() == 256 + 2


def test_relay_tokenizer_trains_one_that_compresses_and_transformers_loads(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    out = tmp_path / "tok"
    assert relay_main(["tokenizer", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    trained = tokenizer.load(out)
    assert 258 < trained.get_vocab_size() <= 300
    assert f"{trained.get_vocab_size()} tokens" in capsys.readouterr().out
    ids = trained.encode(TEXT).ids
    assert len(ids) < len(TEXT.encode("utf-8")) / 2  # merges learnt from the corpus
    assert trained.decode(ids) == TEXT
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf(TEXT)["input_ids"] == ids
    assert relay_main(["tokenizer", str(corpus), "--out", str(out), "--vocab-size", "100"]) == 2


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"family": "llama", "n_embd": 64}, "model.n_embd: not a field of LlamaConfig"),
        ({"n_embd": 64}, "model.n_embd: set model.width instead"),
        ({"vocab_size": 100}, "model.vocab_size: comes from the tokenizer"),
        ({"heads": 5}, "model.heads: 5 does not divide model.width (32)"),
        ({"block_size": 500}, "model.block_size: 500 exceeds model.context"),
        ({"family": "bert"}, "model.family: bert has no hf-causal-lm model"),
        ({"family": "t5"}, "model.family"),
        ({"pretrained": "/nonexistent"}, "model.pretrained: no config.json"),
    ],
)
def test_config_errors_name_the_field(model, message):
    with pytest.raises(ConfigError) as info:
        from_dict({"task": "hf-causal-lm", "size": "debug", "model": model})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("name", "family", "layers"),
    [
        ("hf-causal-lm", "gpt2", "transformer.h"),
        ("hf-causal-lm", "llama", "model.layers"),
        ("hf-sequence-classification", "bert", "bert.encoder.layer"),
    ],
)
def test_fsdp_units_are_the_models_own_layer_list(name, family, layers):
    task = build_task(name, "debug", {"family": family, "layers": 3})
    model = task.build_model()
    assert parallel.units(model) == list(model.get_submodule(layers))


def _saved_gpt2(directory, vocab_size: int):
    config = transformers.GPT2Config(
        n_embd=48, n_layer=2, n_head=4, n_positions=96, vocab_size=vocab_size
    )
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    return model


def test_a_local_pretrained_directory_is_loaded_whole(tmp_path):
    """What fine-tuning starts from: a directory written by save_pretrained, its config deciding
    the shape (the size preset's is not used) and its tokenizer used when it has one."""
    tok = tokenizer.train([TEXT], 280)
    tokenizer.save(tok, tmp_path)
    saved = _saved_gpt2(tmp_path, tok.get_vocab_size())
    task = build_task("hf-causal-lm", "debug", {"pretrained": str(tmp_path)})
    assert task.tokenizer.encode(TEXT).ids == tok.encode(TEXT).ids
    assert task.context == 96
    model = task.build_model()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # A classifier from the same directory: the body's weights, a new head.
    classifier = build_task("hf-sequence-classification", "debug", {"pretrained": str(tmp_path)})
    body = classifier.build_model().state_dict()
    assert torch.equal(body["transformer.wte.weight"], saved.state_dict()["transformer.wte.weight"])
    assert body["score.weight"].shape == (5, 48)
    # A tokenizer with more tokens than the model's embedding is refused.
    small = _saved_gpt2(tmp_path / "small", vocab_size=258)
    with pytest.raises(ConfigError, match=r"model\.tokenizer: 280 tokens"):
        from_dict(
            {
                "task": "hf-causal-lm",
                "size": "debug",
                "model": {"pretrained": str(tmp_path / "small"), "tokenizer": str(tmp_path)},
            }
        )
    assert small.config.vocab_size == 258


def test_a_pretrained_directorys_own_wordpiece_tokenizer_keeps_its_special_tokens(tmp_path):
    """A BERT-style tokenizer.json ([SEP], [PAD]) beside the weights: its own tokens end and
    pad the texts, as the model was pretrained with them."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer()
    wordpiece.train_from_iterator([TEXT], vocab_size=120)
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=wordpiece.get_vocab_size(),
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    task = build_task("hf-sequence-classification", "debug", {"pretrained": str(tmp_path)})
    assert (task.end_id, task.pad_id) == (
        wordpiece.token_to_id("[SEP]"),
        wordpiece.token_to_id("[PAD]"),
    )
    ids = task.preprocess({"text": ["return x"], "label": ["return"]})["input_ids"][0].tolist()
    pad = wordpiece.token_to_id("[PAD]")
    kept = wordpiece.encode("return x").ids
    assert ids == kept + [pad] * (len(ids) - len(kept))  # padded with its own [PAD]
    model = task.build_model()
    (prediction,) = task.predict(model.eval(), task.validate_instances(["return x"]))
    assert prediction.label in task.hp.labels
    task.save_assets(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["architectures"] == ["BertForSequenceClassification"]


@pytest.mark.parametrize("name", ["hf-causal-lm", "hf-sequence-classification"])
def test_a_checkpoint_is_a_hugging_face_model_directory(tmp_path, name):
    """relay's checkpoint files plus config.json and the tokenizer: transformers' Auto classes
    load it, and compute what relay's own loading computes."""
    task = build_task(name, "debug")
    torch.manual_seed(0)
    model = task.build_model().eval()
    meta = {"epoch": 1, "config": {"task": name, "size": "debug"}}
    checkpoint.save(tmp_path, model, meta=meta)
    task.save_assets(tmp_path)
    _, reloaded = checkpoint.load_model(tmp_path)
    auto = {
        "hf-causal-lm": transformers.AutoModelForCausalLM,
        "hf-sequence-classification": transformers.AutoModelForSequenceClassification,
    }[name]
    hf_model = auto.from_pretrained(tmp_path).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([hf_tokenizer("import os.path")["input_ids"]])
    assert ids[0].tolist() == task.tokenizer.encode("import os.path").ids
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        assert torch.allclose(hf_model(input_ids=ids).logits, expected, atol=1e-5)
        assert torch.allclose(reloaded(input_ids=ids).logits, expected, atol=1e-5)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 258 and config["architectures"] == [type(model).__name__]


def test_generation_is_seeded_per_instance_and_stops_at_the_context():
    task = build_task("hf-causal-lm", "debug")
    torch.manual_seed(0)
    model = task.build_model().eval()
    seeded = {"prompt": "def main(", "max_new_tokens": 16, "seed": 7}
    alone = task.predict(model, task.validate_instances([seeded]))
    batched = task.predict(
        model, task.validate_instances([{"prompt": "def main(", "max_new_tokens": 16}, seeded])
    )
    assert alone[0] == batched[1] and alone[0].text
    greedy = {"prompt": "import", "max_new_tokens": 8, "temperature": 0}
    assert (
        task.predict(model, task.validate_instances([greedy] * 2))
        == task.predict(model, task.validate_instances([greedy])) * 2
    )
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="below the model's context"):
        task.validate_instances([{"prompt": "x", "max_new_tokens": 128}])


def test_classifier_predictions_name_labels_and_sum_to_one():
    task = build_task("hf-sequence-classification", "debug", {"labels": ["a", "b", "c"]})
    torch.manual_seed(0)
    model = task.build_model().eval()
    predictions = task.predict(model, task.validate_instances(["os.path", {"text": "Foo(Bar):"}]))
    for p in predictions:
        assert set(p.probabilities) == {"a", "b", "c"}
        assert sum(p.probabilities.values()) == pytest.approx(1.0, abs=1e-5)
        assert p.label == max(p.probabilities, key=p.probabilities.get)
    rows = task.preprocess({"text": ["x", "y"], "label": ["c", "a"]})
    assert rows["label"].tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"labels \['z'\] are not in model.labels"):
        task.preprocess({"text": ["x"], "label": ["z"]})
