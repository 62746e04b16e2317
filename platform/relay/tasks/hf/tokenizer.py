"""Tokenizers for the Hugging Face tasks, made with the `tokenizers` library and never fetched.

Two kinds, both byte-level BPE (GPT-2's scheme, so every text encodes and nothing is unknown):

- "bytes": the 256 byte values and no merges — one token per UTF-8 byte, nothing to train;
- a directory (or tokenizer.json) written by `train` on the training corpus (`relay tokenizer`),
  with merges learnt up to a vocabulary size.

Either way two special tokens are added: END (end of text; generation stops at it) and PAD.
A pretrained directory's own tokenizer.json may name them otherwise ("</s>", "[SEP]", "[PAD]",
...; without a padding token, END pads). A checkpoint carries its tokenizer in Hugging Face's
layout (`save`), so `transformers.AutoTokenizer.from_pretrained(checkpoint)` loads it too.
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
# The names other tokenizers give these two roles, relay's first.
END_NAMES = (END, "</s>", "[SEP]", "<|end_of_text|>", "<eos>")
PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


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
    special_ids(tokenizer, where=file)  # fails now, naming the file, when END has no token
    return tokenizer


def special_ids(tokenizer: Tokenizer, where: object = "the tokenizer") -> tuple[int, int]:
    """(end of text, padding) token ids; padding falls back to end of text."""

    def first(names: tuple[str, ...]) -> int | None:
        ids = [tokenizer.token_to_id(name) for name in names]
        return next((i for i in ids if i is not None), None)

    end, pad = first(END_NAMES), first(PAD_NAMES)
    if end is None:
        raise ValueError(f"{where} has no end-of-text token (one of {', '.join(END_NAMES)})")
    return end, end if pad is None else pad


def has_tokenizer(directory: str | Path) -> bool:
    return (Path(directory) / FILE).is_file()


def save(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write `tokenizer` in Hugging Face's layout (tokenizer.json, tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    end, pad = (tokenizer.id_to_token(i) for i in special_ids(tokenizer))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=end, eos_token=end, pad_token=pad
    ).save_pretrained(str(directory))
