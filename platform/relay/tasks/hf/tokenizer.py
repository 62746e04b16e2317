"""Tokenizers for the Hugging Face tasks, made with the `tokenizers` library and never fetched.

Two kinds, both byte-level BPE (GPT-2's scheme, so every text encodes and nothing is unknown):

- "bytes": the 256 byte values and no merges — one token per UTF-8 byte, nothing to train;
- a directory (or tokenizer.json) written by `train` on the training corpus (`relay tokenizer`),
  with merges learnt up to a vocabulary size.

Either way two special tokens are added: END (end of text; generation stops at it) and PAD.
A checkpoint carries its tokenizer in Hugging Face's layout (`save`), so
`transformers.AutoTokenizer.from_pretrained(checkpoint)` loads it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BYTES = "bytes"
END = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL = [END, PAD]
FILE = "tokenizer.json"


def _byte_level(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer() -> Tokenizer:
    """One token per byte: BPE over GPT-2's byte alphabet with no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = _byte_level(
        Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    )
    tokenizer.add_special_tokens(SPECIAL)
    return tokenizer


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer learnt from `texts`, with at most `vocab_size` tokens."""
    tokenizer = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load(source: str | Path) -> Tokenizer:
    """ "bytes", a tokenizer.json file, or a directory holding one."""
    if str(source) == BYTES:
        return byte_tokenizer()
    path = Path(source).expanduser()
    file = path / FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no {FILE} at {path} (train one with `relay tokenizer`)")
    tokenizer = Tokenizer.from_file(str(file))
    for token in SPECIAL:
        if tokenizer.token_to_id(token) is None:
            raise ValueError(f"{file} lacks the special token {token!r} relay needs")
    return tokenizer


def has_tokenizer(directory: str | Path) -> bool:
    return (Path(directory) / FILE).is_file()


def save(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write `tokenizer` in Hugging Face's layout (tokenizer.json, tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END, eos_token=END, pad_token=PAD
    ).save_pretrained(str(directory))
