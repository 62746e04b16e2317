"""The efficiency report's probe stays proportionate to the model: the step split it times
after the last epoch costs a few of training's own steps, whatever a step takes."""

from __future__ import annotations

import pytest

from relay.training.efficiency.on_workers import PROBE_PASS_S, PROBE_STEPS, probe_steps


@pytest.mark.parametrize("micro_step_s", [1e-4, 0.01, 0.3, 0.7, 0.99, 1.0, 1.9, 2.0, 5.5, 60.0])
def test_a_timed_pass_costs_at_most_its_budget_or_one_step(micro_step_s):
    steps = probe_steps(micro_step_s)
    assert 1 <= steps <= PROBE_STEPS
    assert steps * micro_step_s <= max(PROBE_PASS_S, micro_step_s)
    # ... and it uses the budget: one more step would not have fit (or the cap is reached).
    assert steps == PROBE_STEPS or (steps + 1) * micro_step_s > PROBE_PASS_S


def test_the_steps_fall_as_training_steps_grow():
    counts = [probe_steps(s) for s in (0.001, 0.5, 0.8, 1.5, 3.0, 30.0)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] == PROBE_STEPS and counts[-1] == 1


def test_a_process_probes_its_matmul_peak_once_per_dtype():
    # A sweep's reused trial actor trains trial after trial: the probe (~0.5 s, several times a
    # small trial's epoch) runs for its first trial only.
    import torch

    from relay.training.efficiency import on_workers

    on_workers._peaks.clear()
    first = on_workers.matmul_peak(torch.float32)
    again = on_workers.matmul_peak(torch.float32)
    other = on_workers.matmul_peak(torch.bfloat16)
    assert first["reused"] is False and first["flops_per_s"] > 0
    assert again == {**first, "reused": True}
    assert other["reused"] is False  # a dtype of its own: measured, not the fp32 rate
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
    try:
        assert on_workers.matmul_peak(torch.float32)["reused"] is False  # other thread count
    finally:
        torch.set_num_threads(threads)
