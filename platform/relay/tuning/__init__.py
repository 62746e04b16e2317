"""Tuning: sweeps over the same train loop (Ray Tune), search algorithms, ASHA
promotion, PBT, and the sweep records."""
