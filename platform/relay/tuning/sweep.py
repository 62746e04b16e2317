"""Hyperparameter sweeps: Ray Tune with ASHA over the same train loop.

Every trial is a small Tune "driver" function that trains its run through `driver.fit`, the
same as `relay train`, and forwards each epoch's report to Tune, so ASHA sees per-epoch metrics
and stops weak trials early. Which process trains depends on the trial:

- A trial of one worker (`in_actor`, the default; see `trains_in_actor` for which qualify)
  trains in its Tune trial's own actor (training/in_process.py). The actor holds the worker's
  resources and Tune reuses it for the next trial: no worker group, no controller, no process
  start per trial. A failed trial is Tune's to retry (from `train.failure.max_failures`); it
  resumes its run from the run's last checkpoint.
- Any other trial fits its own TorchTrainer (N DDP workers) — the Ray Train V2 pattern:
  `RunConfig(name=<stable per trial>, callbacks=[TuneReportCallback()])`. The sweep is then
  distributed twice over: trials in parallel, each trial data-parallel.
- search_alg pbt and asha.strategy promote trials wait for Tune's decision at their
  interval or rung epochs, whichever process trains them (pbt.trial_driver).

    <storage>/sweeps/<sweep id>/     Tune's experiment state (what `--resume` restores),
                                     sweep.json (the validated sweep config) and, for
                                     asha.strategy promote, promotion.json (its rungs)
    <storage>/runs/<sweep id>-<trial id>/   each trial's Train run, as any other run
    <storage>/runs/<sweep id>-<trial id>-p<n>/   search_alg pbt: the run a trial continues in
                                     after its n-th copy of another trial's checkpoint (pbt.py)
"""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import ray
import ray.train
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import ConcurrencyLimiter, SearchAlgorithm, Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator

from relay.config import SearchDimension, SweepConfig, sweep_from_dict, trial_config
from relay.observe import doctor, tracking
from relay.records import registry, sweep_records
from relay.runtime import cluster, ray_private
from relay.training import driver
from relay.training.data import ingest
from relay.tuning import pbt, promotion

SPEC = "sweep.json"


def sweeps_root(storage: Path) -> Path:
    return storage / "sweeps"


def _tune_domain(dimension: SearchDimension, *, enumerate_choices: bool = False):
    kind = dimension.kind
    value = getattr(dimension, kind)
    if kind == "choice" and not enumerate_choices:
        return tune.choice(value)
    if kind in ("grid", "choice"):
        return tune.grid_search(value)
    return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[kind](
        *value
    )


def param_space(cfg: SweepConfig) -> dict[str, Any]:
    """Tune's param_space: the searched fields under "params" (dotted keys stay whole: Tune
    and Optuna nest on "/" only). search_alg grid enumerates `choice` fields as grids too."""
    grid = cfg.search_alg == "grid"
    return {"params": {k: _tune_domain(d, enumerate_choices=grid) for k, d in cfg.search.items()}}


def promoting(cfg: SweepConfig) -> bool:
    """Whether the sweep runs promotion-based ASHA (promotion.py)."""
    return cfg.search_alg != "pbt" and cfg.asha.enabled and cfg.asha.strategy == "promote"


def promotion_rungs(cfg: SweepConfig) -> list[float]:
    """The epochs where promotion-based ASHA decides: Ray's rungs below max_t."""
    rungs = sweep_records.asha_rungs(cfg.model_dump(mode="json")) or []
    return [r for r in rungs if r < cfg.asha.max_t]


def _searcher(
    cfg: SweepConfig, gate: promotion.RunningGate | None = None
) -> SearchAlgorithm | Searcher:
    """What chooses each trial's config (`search_alg`), bounded to the trials the cluster holds
    at once (Tune ignores TuneConfig.max_concurrent_trials beside a search_alg given here).
    With a `gate` (promotion-based ASHA), the gate holds that bound: paused trials are live
    to the searcher but hold no slot."""
    limit = max_concurrent_trials(cfg)
    if cfg.search_alg == "pbt":
        # PBT compares and copies between live trials: the whole population trains at once
        # (run() checked that the cluster holds it).
        limit = cfg.population
    if gate is not None:
        if cfg.search_alg == "tpe":
            return promotion.GatedLimiter(_optuna_tpe(cfg), gate, max_concurrent=cfg.population)
        return promotion.GatedVariants(gate, random_state=cfg.seed)
    if cfg.search_alg == "tpe":
        return ConcurrencyLimiter(_optuna_tpe(cfg), max_concurrent=limit)
    # random and grid (param_space made every grid field a grid_search) are Tune's variant
    # generator, seeded; pbt draws its starting population the same way (its scheduler then
    # changes the configs).
    return BasicVariantGenerator(max_concurrent=limit, random_state=cfg.seed)


def _optuna_tpe(cfg: SweepConfig) -> Searcher:
    """Optuna's TPE through Tune's wrapper; Tune hands it param_space, and the wrapper turns
    each Tune domain into the matching Optuna distribution."""
    import warnings

    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not one line per study/trial
    # Optuna warns that list-valued choices (e.g. model.hidden) cannot go to persistent
    # storage; relay's study lives in memory and in Tune's searcher state, which keep them.
    warnings.filterwarnings("ignore", "Choices for a categorical distribution", UserWarning)
    # TPE samples at random for its first n_startup_trials (Optuna's default: 10, meant for
    # studies of hundreds); relay's sweeps are tens of trials, so it models sooner. Seeded, the
    # same seed gives the same configs for the same finished results.
    startup = min(10, max(2, cfg.num_samples // 4))
    sampler = optuna.samplers.TPESampler(seed=cfg.seed, n_startup_trials=startup)
    return OptunaSearch(sampler=sampler)


# Searched fields that may change whether a trial trains in its actor (`trains_in_actor`).
_PROCESS_FIELDS = ("scaling", "data", "checkpoint", "parallel")


def trains_in_actor(cfg: SweepConfig) -> bool:
    """Whether the sweep's trials train in their Tune trial actors (module docstring): one
    worker each, whatever the search samples."""
    from relay.training import in_process

    return (
        cfg.in_actor
        and in_process.unfit_reason(cfg.train) is None
        and not any(key.split(".")[0] in _PROCESS_FIELDS for key in cfg.search)
    )


def _trial_driver(
    params: dict[str, Any],
    *,
    base: dict[str, Any],
    sweep_id: str,
    in_actor: bool = False,
    data: ingest.SharedData | None = None,
) -> None:
    """One trial: the sweep's base config with this trial's sampled values, trained by the same
    `driver.fit` as `relay train` — in this actor (`in_actor`) or by a TorchTrainer. Runs
    inside a Tune trial actor. `data`: the base config's split, put once by the sweep (fit uses
    it only if this trial's config loads the same)."""
    cfg = trial_config(base, params["params"])
    trial_id = tune.get_context().get_trial_id()
    run_id = f"{sweep_id}-{trial_id}"  # stable: a resumed sweep resumes the same run
    labels = {"sweep": sweep_id, "trial_id": trial_id, "params": params["params"]}
    if in_actor:
        to_tune = pbt.ToTune(run_id, trial_id, cfg.epochs)
        pbt.fit_in_actor(cfg, run_id, to_tune, labels=labels, data=data)
        return
    cluster.let_trial_wait_for_workers()
    driver.fit(
        cfg,
        out=None,
        register=False,  # only the sweep's best trial becomes a model version
        run_id=run_id,
        callbacks=[TuneReportCallback()],
        labels=labels,
        data=data,
    )


def max_concurrent_trials(cfg: SweepConfig) -> int:
    """How many trials run at once: as many as the cluster's free resources hold worker groups
    for, plus `cfg.overlap` trials whose worker groups wait for the running ones to end."""
    if cfg.max_concurrent_trials:
        return cfg.max_concurrent_trials
    return trials_that_fit(cfg) + cfg.overlap


def trials_that_fit(cfg: SweepConfig) -> int:
    """How many trials' worker groups the cluster's free resources hold at once."""
    scaling = cfg.train.scaling
    free = ray.available_resources()
    fits = [
        math.floor(free.get(name, 0.0) / (amount * scaling.max_workers))
        for name, amount in scaling.worker_resources.items()
        if amount > 0
    ]
    return max(1, min(fits, default=1))


@dataclass
class SweepResult:
    sweep: str
    trials: list[dict[str, Any]]
    best: dict[str, Any] | None
    model: str | None
    sweep_dir: str

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


class Progress(tune.Callback):
    """A compact live view in the driver: one line per trial epoch, one when a trial ends."""

    def __init__(self, cfg: SweepConfig, out: TextIO) -> None:
        self.cfg, self.out = cfg, out

    def _line(self, trial, text: str) -> None:
        self.out.write(f"  {trial.trial_id:<12} {text}\n")
        self.out.flush()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(self.cfg.metric)
        score = f"{self.cfg.metric} {value:.4f}" if isinstance(value, float) else ""
        epoch = f"epoch {result.get('epoch', '?')}/{self.cfg.asha.max_t}"
        self._line(
            trial, f"{epoch:<11} {score:<24} {sweep_records.short_params(trial.config['params'])}"
        )

    def on_trial_complete(self, iteration, trials, trial, **info):
        epochs = (trial.last_result or {}).get("epoch", 0)
        how = "completed" if epochs >= self.cfg.asha.max_t else "stopped early by ASHA"
        self._line(trial, f"{how} after {epochs} epochs")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._line(trial, f"failed: see {trial.error_file}")


def _tuner(cfg: SweepConfig, sweep_id: str, storage: Path, out: TextIO | None, restore: bool):
    base = cfg.train.model_dump(mode="json")
    in_actor = trains_in_actor(cfg)
    # The base's split goes to the object store once, for every trial (not once each).
    shared = ingest.put_for_trials(cfg.train, cfg.search)
    if cfg.search_alg == "pbt":  # its driver also hands checkpoints to Tune (see pbt.py)
        driver = tune.with_parameters(
            pbt.trial_driver,
            base=base,
            sweep_id=sweep_id,
            hold_at=pbt.acting_epochs(cfg.pbt.interval, cfg.train.epochs),
            chosen_by="pbt",
            clock=pbt.TIME_ATTR,
            in_actor=in_actor,
            data=shared,
        )
    elif promoting(cfg):  # the same driver, its runs waiting at each rung for Tune's decision
        driver = tune.with_parameters(
            pbt.trial_driver,
            base=base,
            sweep_id=sweep_id,
            hold_at=frozenset(math.ceil(r) for r in promotion_rungs(cfg)),
            chosen_by=cfg.search_alg,
            in_actor=in_actor,
            data=shared,
        )
    else:
        driver = tune.with_parameters(
            _trial_driver, base=base, sweep_id=sweep_id, in_actor=in_actor, data=shared
        )
    if in_actor:  # the actor is the trial's one worker
        resources = tune.PlacementGroupFactory([dict(cfg.train.scaling.worker_resources)])
    else:
        # The driver only waits on its TorchTrainer, which reserves the real resources. Tune
        # refuses a bare {"cpu": 0}, hence the token memory request.
        resources = {"cpu": 0, "memory": 1 << 20}
    trainable = tune.with_resources(driver, resources)
    path = sweeps_root(storage) / sweep_id
    if restore:
        return tune.Tuner.restore(
            str(path), trainable=trainable, resume_unfinished=True, resume_errored=True
        )
    # The scheduler decides when trials stop (ASHA) or change config (PBT); _searcher(cfg)
    # decides what each new trial starts from. TPE runs beside ASHA: Optuna learns from every
    # trial's last reported metric, stopped early or not.
    scheduler, gate = None, None
    if cfg.search_alg == "pbt":
        scheduler = pbt.scheduler(cfg)
    elif promoting(cfg):
        gate = promotion.RunningGate(max_concurrent_trials(cfg))
        scheduler = promotion.PromotingASHA(
            metric=cfg.metric,
            mode=cfg.mode,
            time_attr="epoch",
            max_t=cfg.asha.max_t,
            rungs=promotion_rungs(cfg),
            reduction_factor=cfg.asha.reduction_factor,
            population=cfg.population,
            gate=gate,
        )
    elif cfg.asha.enabled:
        scheduler = ASHAScheduler(
            time_attr="epoch",
            max_t=cfg.asha.max_t,
            grace_period=cfg.asha.grace_period,
            reduction_factor=cfg.asha.reduction_factor,
        )
    return tune.Tuner(
        trainable,
        param_space=param_space(cfg),
        tune_config=tune.TuneConfig(
            metric=cfg.metric,
            mode=cfg.mode,
            scheduler=scheduler,
            num_samples=cfg.num_samples,
            search_alg=_searcher(cfg, gate),
            # An in-actor trial's actor trains the next trial (its state is the run's, reset by
            # each start of the driver); a TorchTrainer trial's actor holds only its driver.
            reuse_actors=in_actor,
        ),
        run_config=tune.RunConfig(
            name=sweep_id,
            storage_path=str(sweeps_root(storage)),
            callbacks=[Progress(cfg, out)] if out is not None else [],
            verbose=0,
            # An in-actor trial has no worker group to restart: Tune restarts the trial, which
            # resumes its run from the last checkpoint. A TorchTrainer trial restarts its own.
            failure_config=tune.FailureConfig(
                max_failures=cfg.train.failure.max_failures if in_actor else 0
            ),
        ),
    )


def run(
    cfg: SweepConfig,
    *,
    out: TextIO | None = sys.stdout,
    verbose: bool = False,
    resume: str | None = None,
    storage: Path | None = None,
) -> SweepResult:
    """Run (or, with `resume=<sweep id>`, continue) a sweep; register its best trial."""
    storage = storage or cfg.train.storage_path()
    sweep_id = sweep_records.check_sweep_id(resume) if resume else driver.new_run_id(cfg.name)
    sweep_dir = sweeps_root(storage) / sweep_id
    cluster.connect(verbose=verbose, num_cpus=ingest.cpus_to_start(cfg.train))
    if cfg.search_alg == "pbt":  # before anything is written: a population that cannot fit
        pbt.check_capacity(cfg, cfg.max_concurrent_trials or trials_that_fit(cfg))
    if not verbose:
        # Tune's own reporter (a box per sweep, a table per interval) gives way to ours.
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if not resume:
        registry.make_dir(sweep_dir, exist_ok=False)  # 0700, as runs (see registry)
        (sweep_dir / SPEC).write_text(cfg.model_dump_json(indent=2))
    if out is not None:
        verb = "resuming" if resume else "sweep"
        out.write(
            f"{verb} {sweep_id}: search {cfg.search_alg}, {cfg.num_samples} samples of "
            f"{len(cfg.search)} fields, "
            f"{cfg.train.scaling.describe()} per trial, "
            + (
                f"PBT every {cfg.pbt.interval} epochs of {cfg.train.epochs}\n"
                if cfg.search_alg == "pbt"
                else f"ASHA {'on' if cfg.asha.enabled else 'off'} (max_t {cfg.asha.max_t})\n"
            )
        )
    tracking.open_sweep(cfg, sweep_dir, sweep_id, resume=resume is not None)
    try:
        # Trials trained in their actors start no Train controller and no placement group of
        # their own (Tune's trial groups are Tune's to remove): nothing to reclaim or wait for.
        reclaim = nullcontext() if trains_in_actor(cfg) else ray_private.reclaiming_orphans()
        with reclaim:
            grid = _tuner(cfg, sweep_id, storage, out, restore=resume is not None).fit()
        result = _summarize(cfg, sweep_id, sweep_dir, storage, grid, out)
    except BaseException as exc:
        tracking.close_sweep(sweep_dir, "FAILED" if isinstance(exc, Exception) else "KILLED", None)
        raise
    tracking.close_sweep(sweep_dir, "FINISHED", result.to_json_dict())
    if out is not None and (where := tracking.sweep_where(sweep_dir)):
        out.write(where + "\n")
    return result


def load_spec(storage: Path, sweep_id: str) -> SweepConfig:
    path = sweeps_root(storage) / sweep_records.check_sweep_id(sweep_id) / SPEC
    if not path.exists():
        raise KeyError(f"no sweep {sweep_id!r} under {sweeps_root(storage)}")
    # Validated as a config file is (a ConfigError, exit 2): e.g. a tpe sweep resumed where
    # Optuna is not installed.
    return sweep_from_dict(json.loads(path.read_text()))


def _trial_summary(cfg: SweepConfig, sweep_id: str, result) -> dict[str, Any]:
    metrics = {k: v for k, v in (result.metrics or {}).items() if not isinstance(v, dict)}
    epochs = metrics.get("epoch", 0)
    trial_id = metrics.get("trial_id", "unknown")
    if result.error is not None:
        status = "error"
    elif epochs >= cfg.asha.max_t:
        status = "completed"
    else:
        status = "stopped"
    keep = {"epoch", cfg.metric, "train_loss", "val_loss", "samples_per_s"}
    return {
        "trial_id": trial_id,
        "run_id": f"{sweep_id}-{trial_id}",
        "config": result.config["params"],
        "chosen_by": _chosen_by(cfg, metrics),
        "status": status,
        "epochs_run": epochs,
        "metrics": {k: v for k, v in metrics.items() if k in keep},
        "best_score": _best_score(cfg, result),
    }


def _chosen_by(cfg: SweepConfig, metrics: dict[str, Any]) -> str:
    """Which algorithm chose the trial's config: the sweep's search_alg, unless the trial
    reported its own origin as a `chosen_by` metric (e.g. PBT's "pbt:exploit <trial id>")."""
    return str(metrics.get("chosen_by") or cfg.search_alg)


def _best_score(cfg: SweepConfig, result) -> float | None:
    frame = result.metrics_dataframe
    if frame is None or cfg.metric not in frame:
        return None
    values = frame[cfg.metric].dropna()
    if values.empty:
        return None
    return float(values.max() if cfg.mode == "max" else values.min())


def _best_checkpoint(cfg: SweepConfig, storage: Path, run_id: str) -> tuple[str | None, dict]:
    """The best checkpoint of a trial's Train run (also for trials ASHA stopped mid-run)."""
    run_dir = registry.runs_root(storage) / run_id
    record = registry.get_run(storage, run_id)
    if record.get("status") == "finished" and record.get("checkpoint"):
        return record["checkpoint"], record.get("best_metrics", {})
    result = ray.train.Result.from_path(str(run_dir))
    best = result.get_best_checkpoint(cfg.metric, cfg.mode)
    if best is None:
        return None, {}
    metrics = next((m for c, m in result.best_checkpoints if c.path == best.path), {})
    return best.path, metrics


def _settle_records(cfg: SweepConfig, storage: Path, trials: list[dict[str, Any]]) -> None:
    """Tune's verdict on each trial, written into its run's record where the run could not.

    When ASHA says stop, Tune ends the trial from outside by killing its actor: mid-run for a
    trial stopped early, but also at a trial's last epoch (max_t), while its fit() may still be
    finishing. The run's record then says "running", or "failed" (ActorDiedError) when the
    kill reached fit() before the actor died. A stopped trial's run becomes "stopped"; a
    completed one's "finished", with its best checkpoint from Ray Train's own record and where
    its ranks ran, as fit() would have written it. Its MLflow run, left open, is closed."""
    for trial in trials:
        run_dir = registry.runs_root(storage) / trial["run_id"]
        if not (run_dir / registry.RECORD).exists():
            continue
        record = registry.get_run(storage, trial["run_id"])
        if trial["status"] == "stopped":
            record.pop("error", None)
            registry.write(run_dir, {**record, "status": "stopped", "metrics": trial["metrics"]})
            tracking.ended_from_outside(record, "KILLED")
        elif trial["status"] == "completed" and record["status"] != "finished":
            checkpoint, best_metrics = _best_checkpoint(cfg, storage, trial["run_id"])
            record.pop("error", None)
            settled = {
                **record,
                "status": "finished",
                "finished_at": datetime.now(UTC).isoformat(),
                "metrics": trial["metrics"],
                "checkpoint": checkpoint,
                "best_metrics": best_metrics,
                "placement": doctor.heartbeat.placement(run_dir),
                "settled_by_sweep": True,  # written here, not by the run's own fit()
            }
            registry.write(run_dir, settled, final=True)
            tracking.ended_from_outside(record, "FINISHED")


def _summarize(cfg, sweep_id, sweep_dir, storage, grid, out) -> SweepResult:
    trials = sorted((_trial_summary(cfg, sweep_id, r) for r in grid), key=lambda t: t["trial_id"])
    if cfg.search_alg == "pbt":  # a trial's runs: one per stretch between exploits
        pbt.add_lineage(cfg, storage, sweep_id, trials)
    _settle_records(cfg, storage, trials)

    scored = [t for t in trials if t["best_score"] is not None]
    best, model = None, None
    if scored:
        sign = 1 if cfg.mode == "max" else -1
        winner = max(scored, key=lambda t: sign * t["best_score"])
        checkpoint, metrics = _best_checkpoint(cfg, storage, winner["run_id"])
        best = {**winner, "checkpoint": checkpoint, "checkpoint_metrics": metrics}
        if checkpoint:
            best_cfg = trial_config(cfg.train.model_dump(mode="json"), winner["config"])
            version = driver.register_model(
                best_cfg, winner["run_id"], checkpoint, metrics, cfg.model_name
            )
            model = f"{version['model']}:{version['version']}"
    result = SweepResult(sweep_id, trials, best, model, str(sweep_dir))
    (sweep_dir / "result.json").write_text(json.dumps(result.to_json_dict(), indent=2, default=str))
    if out is not None:
        _print_summary(cfg, result, out)
    return result


def _print_summary(cfg: SweepConfig, result: SweepResult, out: TextIO) -> None:
    out.write(f"\nsearch {cfg.search_alg}, {len(result.trials)} trials\n")
    out.write(
        f"{'trial':<12} {'status':<10} {'epochs':>6} {cfg.metric:>14}  {'chosen_by':<10} config\n"
    )
    for t in result.trials:
        score = t["metrics"].get(cfg.metric)
        score = f"{score:.4f}" if isinstance(score, float) else "-"
        out.write(
            f"{t['trial_id']:<12} {t['status']:<10} {t['epochs_run']:>6} {score:>14}  "
            f"{t['chosen_by']:<10} {sweep_records.short_params(t['config'])}\n"
        )
    if result.best:
        b = result.best
        out.write(
            f"best: {b['trial_id']} {cfg.metric}={b['best_score']:.4f} "
            f"({sweep_records.short_params(b['config'])})\n"
            f"checkpoint: {b['checkpoint']}\nmodel: {result.model}\n"
        )
    else:
        out.write("no trial reported a score\n")
