"""The `relay` command: main.py builds the parser and dispatches; one module per flow holds its
commands (train.py, tune.py, records.py; serving/command.py serves), common.py what they share."""

from relay.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
