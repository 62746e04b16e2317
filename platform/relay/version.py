"""relay's version: its own module, so that what records it (checkpoints, MLflow tags) need not
import the package's API, which imports the whole training path."""

__version__ = "0.1.0"
