"""ASHA as published (Li et al., "A System for Massively Parallel Hyperparameter Tuning", 2020):
promotions instead of Ray's stopping rule (`asha.strategy: promote`).

Ray's ASHAScheduler decides when a trial reaches a rung: it continues if it ranks in the top
1/reduction_factor of the results recorded there *so far*. The first trial to reach a rung has
nothing to rank against, so it always continues; with a few trials and one or two slots, the
first arrivals — however weak — train to the end (measured: a sweep of 6 trials trained 31 of
36 epochs, a trial of lr 1.4e-5 among them). Here a trial that reaches a rung *pauses* unless
it already ranks in the rung's top 1/reduction_factor, counted over everything recorded there;
a free slot resumes the best paused trial that has since become promotable (higher rungs
first), else starts a new trial. A sweep that can start nothing more ends its top rung with its
best paused trial, so at least one trial trains to `max_t`.

A trial's Train run reports the rung's epoch with its checkpoint and its controller waits
there for the decision (pbt.trial_driver's hold; its workers may begin the next epoch). A
paused trial's run is stopped; resuming it starts its driver again, and `driver.fit` with the
trial's stable run id resumes that run from the rung's checkpoint, the latest Train recorded.
Each promotion of a paused trial therefore costs one run start-up: the price of never letting
a weak early arrival run to the end.

Tune starts every PENDING trial it has (its trial actors reserve no real resources; each
trial's TorchTrainer does), so the number of trials training at once is held by the searcher,
which draws a new trial only while fewer than the sweep's limit train (`RunningGate`): a
paused trial holds no slot, which the searcher's own concurrency limit cannot express.

`relay tune --resume`: Tune saves its trials and its searcher, not its scheduler, and re-queues
every unfinished trial as PENDING. So the scheduler stages what it recorded and promoted at
each rung (promotion.json) where Tune stages its own state, which Tune uploads to the sweep's
directory with its trials' and its searcher's and downloads on a resume; the resumed scheduler
reads it back and puts each trial that was waiting at a rung back to PAUSED. The restored
searcher keeps the scheduler's gate, not the copy in its saved state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.basic_variant import BasicVariantGenerator

STATE = "promotion.json"  # in the sweep's directory: what each rung recorded and promoted


class RunningGate:
    """Whether a new trial may start: fewer than `limit` trials train now (RUNNING, or
    PENDING: about to), and no paused trial waits for promotion (promotions go first, as in
    ASHA). The scheduler hands it the trial list and its promotion check."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._trials = None  # TuneController.get_trials, once the scheduler has seen it
        self._promotion_waiting = None

    def watch(self, tune_controller, promotion_waiting) -> None:
        self._trials, self._promotion_waiting = tune_controller.get_trials, promotion_waiting

    def has_room(self) -> bool:
        if self._trials is None:
            return True
        busy = sum(t.status in (Trial.RUNNING, Trial.PENDING) for t in self._trials())
        return busy < self.limit

    def open(self) -> bool:
        return self.has_room() and not (self._promotion_waiting and self._promotion_waiting())

    def __getstate__(self) -> dict[str, Any]:  # Tune saves its searcher's state; not these
        return {"limit": self.limit, "_trials": None, "_promotion_waiting": None}


class KeepsGate:
    """Restores a gated searcher's saved state but keeps its gate. Unpickled together from
    Tune's saved tuner, the searcher and the scheduler share one gate; the searcher's saved
    state holds a detached copy (RunningGate saves no references), which would always be open."""

    gate: RunningGate

    def set_state(self, state: dict) -> None:  # a resumed sweep
        gate = self.gate
        super().set_state(state)
        self.gate = gate


class GatedVariants(KeepsGate, BasicVariantGenerator):
    """Tune's random/grid generator, drawing only while the gate is open."""

    def __init__(self, gate: RunningGate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def next_trial(self):
        return super().next_trial() if self.gate.open() else None


class GatedLimiter(KeepsGate, ConcurrencyLimiter):
    """A searcher (TPE) behind the gate; `max_concurrent` counts paused trials too, so the
    caller gives it the whole population."""

    def __init__(self, searcher, gate: RunningGate, max_concurrent: int) -> None:
        super().__init__(searcher, max_concurrent=max_concurrent)
        self.gate = gate

    def suggest(self, trial_id: str):
        return super().suggest(trial_id) if self.gate.open() else None


class PromotingASHA(FIFOScheduler):
    """Asynchronous successive halving by promotion over `rungs` (epochs < max_t).
    `population`: trials the sweep creates, so it knows when no new trial can come."""

    def __init__(
        self,
        *,
        metric: str,
        mode: str,
        time_attr: str,
        max_t: int,
        rungs: list[float],
        reduction_factor: float,
        population: int,
        gate: RunningGate,
    ) -> None:
        super().__init__()
        self._metric, self._mode = metric, mode
        self._time_attr, self._max_t = time_attr, max_t
        self._rf, self._population, self.gate = reduction_factor, population, gate
        self._sign = 1.0 if mode == "max" else -1.0  # scores: higher is better
        # per rung: trial id -> score recorded there; the trial ids promoted from it
        self._recorded: dict[float, dict[str, float]] = {r: {} for r in rungs}
        self._promoted: dict[float, set[str]] = {r: set() for r in rungs}
        self._staging: Path | None = None  # see _attach

    # --- what survives the driver (relay tune --resume) ----------------------------------------

    def _attach(self, trial: Trial) -> None:
        """At the first trial: where Tune stages the sweep's state on this driver (uploaded to
        the sweep's directory with Tune's own, so both describe one moment), and the decisions
        found there — a resumed sweep's, downloaded by Tune before it re-adds the trials."""
        if self._staging is not None:
            return
        self._staging = Path(trial.local_experiment_path)
        if (saved := self._staging / STATE).exists():
            for rung in json.loads(saved.read_text())["rungs"]:
                self._recorded[rung["epoch"]] = rung["recorded"]
                self._promoted[rung["epoch"]] = set(rung["promoted"])

    def _save(self) -> None:
        state = {
            "rungs": [
                {"epoch": r, "recorded": rec, "promoted": sorted(self._promoted[r])}
                for r, rec in self._recorded.items()
            ]
        }
        tmp = self._staging / f"{STATE}.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self._staging / STATE)  # atomic: an upload sees the old state or the new

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its tuner, this scheduler in it; a resumed sweep's driver stages
        # elsewhere and finds the decisions in its own staging directory.
        return {**self.__dict__, "_staging": None}

    def _waiting_at_rung(self, trial_id: str) -> bool:
        """Paused at the highest rung it reached, and not promoted from it since."""
        reached = [r for r, rec in self._recorded.items() if trial_id in rec]
        return bool(reached) and trial_id not in self._promoted[max(reached)]

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        # TuneConfig passes the sweep's metric and mode again: the same ones, given above.
        return metric in (None, self._metric) and mode in (None, self._mode)

    # --- decisions on results ------------------------------------------------------------------

    def _watch(self, tune_controller) -> None:
        self.gate.watch(tune_controller, lambda: self._next_promotion(tune_controller) is not None)

    def on_trial_add(self, tune_controller, trial: Trial) -> None:
        self._watch(tune_controller)
        self._attach(trial)
        if trial.status == Trial.PENDING and self._waiting_at_rung(trial.trial_id):
            # A resumed sweep re-queues its unfinished trials as PENDING, and Tune starts every
            # PENDING trial; one that waited at a rung waits again. (Tune files an added trial
            # under its status after this call.)
            trial.set_status(Trial.PAUSED)

    def on_trial_result(self, tune_controller, trial: Trial, result: dict) -> str:
        self._watch(tune_controller)
        epoch = result.get(self._time_attr, 0)
        if epoch >= self._max_t:
            return TrialScheduler.STOP
        if self._metric not in result:
            return TrialScheduler.CONTINUE
        # As Ray's _Bracket: the highest rung the trial has reached, if not yet recorded there
        # (a rung of a fractional epoch is reached at the next whole one).
        rung = max((r for r in self._recorded if r <= epoch), default=None)
        if rung is None or trial.trial_id in self._recorded[rung]:
            return TrialScheduler.CONTINUE
        self._recorded[rung][trial.trial_id] = self._sign * result[self._metric]
        if trial.trial_id in self._promotable(rung):
            self._promote(rung, trial.trial_id)
            return TrialScheduler.CONTINUE
        self._save()
        return TrialScheduler.PAUSE

    def _promote(self, rung: float, trial_id: str) -> None:
        """Mark the trial promoted from the rung, and save at once: a resumed sweep must not
        promote another in its place."""
        self._promoted[rung].add(trial_id)
        self._save()

    def _promotable(self, rung: float, at_least: int = 0) -> list[str]:
        """Trial ids in the rung's top 1/reduction_factor (at least `at_least`), best first,
        not yet promoted from it."""
        recorded = self._recorded[rung]
        top = sorted(recorded, key=recorded.__getitem__, reverse=True)
        keep = max(int(len(recorded) // self._rf), at_least)
        return [t for t in top[:keep] if t not in self._promoted[rung]]

    def _next_promotion(self, tune_controller) -> tuple[float, Trial] | None:
        """The paused trial to resume next, with its rung: the highest rung's best first."""
        paused = {t.trial_id: t for t in tune_controller.get_trials() if t.status == Trial.PAUSED}
        for rung in sorted(self._recorded, reverse=True):
            for trial_id in self._promotable(rung):
                if trial_id in paused:
                    return rung, paused[trial_id]
        return None

    # --- what a free slot runs -----------------------------------------------------------------

    def choose_trial_to_run(self, tune_controller) -> Trial | None:
        self._watch(tune_controller)
        if self.gate.has_room() and (promotion := self._next_promotion(tune_controller)):
            rung, trial = promotion
            self._promote(rung, trial.trial_id)
            return trial
        trials = tune_controller.get_trials()
        for trial in trials:
            if trial.status == Trial.PENDING:
                return trial
        paused = {t.trial_id: t for t in trials if t.status == Trial.PAUSED}
        busy = any(t.status in (Trial.RUNNING, Trial.PENDING) for t in trials)
        if paused and not busy and len(trials) >= self._population:
            return self._finish(tune_controller, paused)
        return None

    def _finish(self, tune_controller, paused: dict[str, Trial]) -> Trial | None:
        """Nothing trains and no new trial can come. The highest rung that has results but
        promoted none (too few reached it for its top 1/reduction_factor to hold one) promotes
        its best paused trial, so the sweep ends with a trial at max_t; once every rung with
        results has promoted, the paused trials stop. (A rung that promoted none has nothing
        above it: every trial above passed it by promotion.)"""
        for rung in sorted(self._recorded, reverse=True):
            if self._recorded[rung] and not self._promoted[rung]:
                everyone = len(self._recorded[rung])
                waiting = [t for t in self._promotable(rung, at_least=everyone) if t in paused]
                if waiting:
                    self._promote(rung, waiting[0])
                    return paused[waiting[0]]
        for trial in paused.values():
            tune_controller.stop_trial(trial)
        return None

    def debug_string(self) -> str:
        return "promotion-based ASHA: " + ", ".join(
            f"epoch {r}: {len(rec)} recorded, {len(self._promoted[r])} promoted"
            for r, rec in self._recorded.items()
        )
