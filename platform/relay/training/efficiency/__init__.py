"""The efficiency report: how well a run used its cluster, measured — not estimated — on the
workers at the end of training, and completed by the driver.

    total speed ∝ per-device speed × device count × multi-device speedup

Each factor gets a number: throughput overall and per worker; the step split into compute,
gradient communication and the rest (timed by running the same micro-step with and without
gradient synchronisation); model FLOP/s as a fraction of the matmul rate measured on the workers
themselves (not a vendor's peak: see `fraction_of_measured_matmul_peak`); memory per rank (the
storages parameters, gradients and optimizer state really occupy, the activations one forward
keeps for backward, and peak memory growth);
start-up; and, when a 1-worker run of the same config exists, speedup and scaling efficiency.

Three parts, one job each: on_workers.py (`measure`, a collective), on_driver.py (start-up,
the 1-worker reference), text.py (the lines people read). Callers use the names below.
"""

from relay.training.efficiency.on_driver import add_reference, find_reference, startup
from relay.training.efficiency.on_workers import (
    PEAK_PROBE,
    REPORT_VERSION,
    activation_bytes,
    matmul_peak,
    measure,
    model_flops_per_sample,
)
from relay.training.efficiency.text import format_report

__all__ = [
    "PEAK_PROBE",
    "REPORT_VERSION",
    "activation_bytes",
    "add_reference",
    "find_reference",
    "format_report",
    "matmul_peak",
    "measure",
    "model_flops_per_sample",
    "startup",
]
