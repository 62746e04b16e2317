"""`GET /metrics`: requests, latency and batch sizes per model, in Prometheus' text format.

A scrape reaches one replica (HAProxy picks it), yet it must count the whole endpoint. So each
replica keeps its own counts and pushes a snapshot to one small actor per application (the
board) every `PUSH_INTERVAL_S`; the replica that answers a scrape adds the board's snapshots of
the others to its own live one. A replica that is gone keeps its last snapshot on the board, so
the totals never go down. The exposition format is prometheus-client's (installed with Serve).
"""

from __future__ import annotations

import asyncio
import bisect
from collections import defaultdict
from typing import Any

import ray

PUSH_INTERVAL_S = 1.0
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _histogram(bounds: tuple[float, ...]) -> dict[str, Any]:
    return {"counts": [0] * (len(bounds) + 1), "sum": 0.0}  # the last count: above every bound


def _observe(histogram: dict[str, Any], bounds: tuple[float, ...], value: float) -> None:
    histogram["counts"][bisect.bisect_left(bounds, value)] += 1
    histogram["sum"] += value


class ReplicaMetrics:
    """One replica's counts: requests per (model, version, status), request latency and batch
    size per (model, version)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency: dict[tuple[str, str], dict[str, Any]] = {}
        self.batches: dict[tuple[str, str], dict[str, Any]] = {}

    def request(self, model: str, version: str, status: int, seconds: float) -> None:
        self.requests[(model, version, str(status))] += 1
        histogram = self.latency.setdefault((model, version), _histogram(LATENCY_BUCKETS_S))
        _observe(histogram, LATENCY_BUCKETS_S, seconds)

    def batch(self, model: str, version: str, size: int) -> None:
        histogram = self.batches.setdefault((model, version), _histogram(BATCH_BUCKETS))
        _observe(histogram, BATCH_BUCKETS, size)

    def snapshot(self) -> dict[str, list]:
        """JSON-able, for the board."""
        return {
            "requests": [[*key, n] for key, n in self.requests.items()],
            "latency": [[*key, h["counts"], h["sum"]] for key, h in self.latency.items()],
            "batches": [[*key, h["counts"], h["sum"]] for key, h in self.batches.items()],
        }


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The last snapshot each replica pushed."""

    def __init__(self) -> None:
        self.snapshots: dict[str, dict[str, list]] = {}

    def push(self, replica: str, snapshot: dict[str, list]) -> None:
        self.snapshots[replica] = snapshot

    def collect(self) -> dict[str, dict[str, list]]:
        return self.snapshots


def board(app_name: str):
    """The application's board, created by whichever replica asks first. In Serve's namespace
    and detached, like the replicas; removed by the cluster's end (relay serve's own cluster)
    or left for the next deploy of the same application to reuse."""
    return MetricsBoard.options(
        name=f"relay-metrics-{app_name}",
        namespace="serve",
        lifetime="detached",
        get_if_exists=True,
    ).remote()


async def push_forever(metrics: ReplicaMetrics, replica: str, app_name: str) -> None:
    """A replica's background task: its snapshot to the board, every PUSH_INTERVAL_S."""
    handle = board(app_name)
    while True:
        await asyncio.sleep(PUSH_INTERVAL_S)
        try:
            await handle.push.remote(replica, metrics.snapshot())
        except ray.exceptions.RayActorError:  # the board died (its node): start another
            handle = board(app_name)


def render(snapshots: list[dict[str, list]]) -> bytes:
    """All replicas' snapshots, added up, in Prometheus' text format."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.utils import floatToGoString

    requests: dict[tuple, int] = defaultdict(int)
    histograms: dict[str, dict[tuple, dict[str, Any]]] = {"latency": {}, "batches": {}}
    for snapshot in snapshots:
        for *key, n in snapshot["requests"]:
            requests[tuple(key)] += n
        for kind, merged in histograms.items():
            for model, version, counts, total in snapshot[kind]:
                into = merged.setdefault((model, version), {"counts": [0] * len(counts), "sum": 0})
                into["counts"] = [a + b for a, b in zip(into["counts"], counts, strict=True)]
                into["sum"] += total

    families = []
    family = CounterMetricFamily(
        "relay_requests", "Requests answered, by model, version and HTTP status.",
        labels=["model", "version", "code"],
    )  # fmt: skip
    for key, n in sorted(requests.items()):
        family.add_metric(list(key), n)
    families.append(family)
    for kind, name, text, bounds in (
        ("latency", "relay_request_duration_seconds", "Time to answer a request.",
         LATENCY_BUCKETS_S),
        ("batches", "relay_batch_size", "Instances per forward pass.", BATCH_BUCKETS),
    ):  # fmt: skip
        family = HistogramMetricFamily(name, text, labels=["model", "version"])
        for key, h in sorted(histograms[kind].items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*bounds, float("inf")), h["counts"], strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))  # "2.0", "+Inf"
            family.add_metric(list(key), buckets, sum_value=h["sum"])
        families.append(family)

    class Collected:
        def collect(self):
            return families

    return generate_latest(Collected())
