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
