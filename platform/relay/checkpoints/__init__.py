"""Checkpoints: the directory format (whole or sharded) and whole weights from
shards."""
