"""Serving a registered model over HTTP with Ray Serve.

- app.py: the Serve application (FastAPI ingress, batched forwards) and its arguments;
- web.py: the HTTP parts that know nothing of models (error shape, body limit, OpenAPI);
- ingress.py: HAProxy or Serve's Python proxy in front of the replicas, and HAProxy's set-up;
- haproxy_launch.py: starts HAProxy with its admin listeners on loopback;
- command.py: `relay serve`.
"""
