"""Hugging Face Transformers models as relay tasks.

`hf-causal-lm` and `hf-sequence-classification` build a `transformers` model from a config
(`model: {family: gpt2 | llama | bert, width, layers, heads, ...}`) or load one from a local
directory saved with `save_pretrained` (`model.pretrained`), and train it with relay's own loop:
every strategy, precision, accumulation and checkpointing works as for the built-in tasks,
because the model is a plain `nn.Module` whose transformer blocks sit in an `nn.ModuleList`.

Nothing is downloaded: configs are built here, tokenizers are byte-level or trained locally
(`relay tokenizer`), and pretrained weights come from a directory. Each checkpoint of these
tasks is also a Hugging Face model directory (config.json, model.safetensors, tokenizer files).

Needs the `hf` extra (`pip install 'relay[hf]'`); `transformers` is imported only by these
tasks, never by the rest of relay.
"""

from importlib.util import find_spec

if find_spec("transformers") is None or find_spec("tokenizers") is None:
    raise ImportError("the Hugging Face tasks need the hf extra: pip install 'relay[hf]'")
