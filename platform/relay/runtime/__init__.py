"""The Ray runtime relay stands on: getting onto a cluster, background chores,
processes it starts, per-worker memory limits."""
