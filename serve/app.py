"""serve run serve.app:app model=digits:best

The entry Ray Serve's own CLI imports (`serve run`, and `serve deploy serve/config.yaml` on a
running cluster). The application lives in the relay package (relay/serving/app.py documents
the protocol and `AppArgs`); `relay serve digits:best` runs the same one without this file.
"""

from relay.serving.app import AppArgs, app, build, resolve_models

__all__ = ["AppArgs", "app", "build", "resolve_models"]
