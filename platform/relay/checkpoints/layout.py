"""The names of the files in a checkpoint directory (checkpoint.py says what each holds). Their
own module so that everything reading a checkpoint's files (the formats, consolidation) shares
them without importing each other."""

WEIGHTS = "model.safetensors"
TRAIN_STATE = "train_state.pt"
META = "meta.json"
SHARDS = "shards"
