"""Serving registered models over HTTP with Ray Serve.

- app.py: the Serve application: the replica (ModelServer) and the builders Serve and
  `relay serve` call;
- args.py: the application's arguments (AppArgs, ReplicaArgs) and the replicas' version;
- routes.py: each replica's FastAPI app: KServe v1 and v2 routes, OpenAPI, the version header;
- answers.py: request bodies parsed under their limits, answers encoded, models as shown;
- model_table.py: which models an endpoint serves, resolved on the driver, swapped in place;
- batching.py: the adaptive batcher;
- open_inference.py: KServe v2 (Open Inference Protocol) tensors ↔ a task's schemas;
- metrics.py: /metrics, summed over the replicas;
- web.py: the HTTP parts that know nothing of models (error shape, body limit);
- ingress.py: HAProxy or Serve's Python proxy in front of the replicas, and HAProxy's set-up;
- haproxy_launch.py: starts HAProxy with its admin listeners on loopback;
- endpoint.py: where a running `relay serve` is, for `relay deploy`;
- command.py: `relay serve` and `relay deploy`.
"""
