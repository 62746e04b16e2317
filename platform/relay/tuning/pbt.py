"""Population Based Training for sweeps (`search_alg: pbt`): Tune's PopulationBasedTraining
over relay's trial driver; every trial stays a real run of the same loop (in its trial's actor
or a TorchTrainer's worker group: sweep.trains_in_actor).

Every `pbt.interval` epochs the weaker trials take a copy of a stronger trial's checkpoint —
weights, optimizer moments, schedule position and epoch, relay's usual format — and perturb
its hyperparameters (the `search` fields); Tune then restarts each such trial's driver with the
new config and that checkpoint (`tune.get_checkpoint()`).

A trial's history is a chain of Train runs, one per stretch between exploits:

    <storage>/runs/<sweep>-<trial>        its first stretch, from scratch
    <storage>/runs/<sweep>-<trial>-p<n>   the n-th exploit: a fresh Train run that starts from
                                          the donor's checkpoint (record: `init_checkpoint`,
                                          `pbt.from_trial`, `pbt.from_epoch`); its history.jsonl
                                          starts at the donor's epoch + 1

A fresh run per exploit keeps each run's history honest (one lineage of weights per run) and
lets `relay runs` show every stretch as the Train run it was. A trial that restarts from its
*own* checkpoint (the population waiting at an interval, `relay tune --resume`) continues its
current run: Train resumes it from its latest checkpoint.

Train's reports reach Tune through the driver, not `TuneReportCallback`: Tune's PBT copies
*Tune* checkpoints, and that callback forwards only metrics. At each interval epoch the driver
reports a Tune checkpoint holding the Train checkpoint's files, and the run waits there until
Tune has decided (continue, or stop for an exploit). A run in the trial's actor reports from
its loop (`ToTune`), so it trains nothing past that epoch; a TorchTrainer run's controller
waits (`_Forward`, mailbox.py), so it trains no epochs past the one it handed over beyond the
one its workers had already begun.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray import tune

from relay.checkpoints import checkpoint
from relay.config import SweepConfig, trial_config
from relay.records import history, registry
from relay.runtime import ray_private
from relay.training import driver
from relay.tuning.mailbox import Mailbox

# PBT's clock, reported only on the epochs PBT may act after (`acting_epochs`): never a trial's last
# (a copy made there would have nothing left to train), and never between intervals — Tune's
# restore of a sweep sets every trial's last perturbation back to 0, so a resumed trial's first
# epoch past an interval would otherwise act again, from the donor's checkpoint of that interval.
TIME_ATTR = "pbt_epoch"
# In each Tune checkpoint: which Train run, trial and epoch its files came from.
SOURCE = "relay_source.json"


# --- the scheduler -----------------------------------------------------------------------------


class _WithinBounds:
    """PBT's explore multiplies numbers by 0.8 or 1.2 without bounds; keep each number inside
    its search range (the range the user declared valid), integers integral."""

    def __init__(self, cfg: SweepConfig) -> None:
        self.bounds = {
            key: (d.kind, getattr(d, d.kind))
            for key, d in cfg.search.items()
            if d.kind in ("uniform", "loguniform", "randint")
        }

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        params = config["params"]
        for key, (kind, (low, high)) in self.bounds.items():
            if kind == "randint":  # [low, high)
                params[key] = int(min(max(round(params[key]), low), high - 1))
            else:
                params[key] = float(min(max(params[key], low), high))
        return config


def mutations(cfg: SweepConfig) -> dict[str, Any]:
    """PBT's explore space from the sweep's `search`: numbers are perturbed (or resampled from
    their distribution), choices and grids move to a neighbouring value (or are resampled)."""
    space: dict[str, Any] = {}
    for key, dimension in cfg.search.items():
        value = getattr(dimension, dimension.kind)
        if dimension.kind in ("choice", "grid"):
            space[key] = list(value)
        else:
            domain = {"uniform": tune.uniform, "loguniform": tune.loguniform}
            space[key] = domain.get(dimension.kind, tune.randint)(*value)
    return {"params": space}


def scheduler(cfg: SweepConfig):
    # Tune advises reuse_actors with PBT; relay reuses the actors of in-actor trials only: a
    # stopped TorchTrainer trial's actor still holds its Train run, so each start needs a
    # fresh actor (sweep._tuner).
    warnings.filterwarnings("ignore", "Consider boosting PBT performance", UserWarning)
    return ray_private.population_based_training(
        seed=cfg.seed,  # explore and the choice of donor, reproducible (null: fresh draws)
        time_attr=TIME_ATTR,
        perturbation_interval=cfg.pbt.interval,
        hyperparam_mutations=mutations(cfg),
        quantile_fraction=cfg.pbt.quantile_fraction,
        resample_probability=cfg.pbt.resample_probability,
        custom_explore_fn=_WithinBounds(cfg),
        synch=cfg.pbt.synch,
        # Most reports carry no TIME_ATTR, on purpose (see above).
        require_attrs=False,
    )


def acting_epochs(interval: int, epochs: int) -> frozenset[int]:
    """The epochs PBT may exploit/explore after: there the report carries a checkpoint."""
    return frozenset(range(interval, epochs, interval))


# --- Train's reports to Tune, through the driver -----------------------------------------------


class _Forward(ray.train.UserCallback):
    """On the Train controller: each epoch's rank-0 metrics (and checkpoint path) to the
    driver's mailbox; at the epochs in `hold_at` the run waits there for Tune's decision."""

    def __init__(self, mailbox, hold_at: frozenset[int]) -> None:
        self.mailbox, self.hold_at = mailbox, hold_at

    def after_report(self, run_context, metrics, checkpoint) -> None:
        report = dict(metrics[0])
        path = checkpoint.path if checkpoint else None
        if path:
            report["checkpoint_path"] = path  # as TuneReportCallback names it
        hold = report.get("epoch", 0) in self.hold_at
        ray.get(self.mailbox.put.remote((report, path, hold), hold))


class ToTune(ray.train.UserCallback):
    """A run's reports to Tune from a trial that trains in its own actor (hosts.TrialProcess
    calls it in the loop's thread, so each `tune.report` holds the loop until Tune has taken
    it; a trial Tune stops ends there). At the epochs in `hold_at` the report carries a Tune
    checkpoint (PBT's exploits, promotion's pauses copy and restore those) and, with a
    `clock`, that epoch as PBT's time. `chosen_by` names what chose the trial's config.

    The last epoch's report waits until the run has finished (`send_last`): Tune stops a trial
    at its last epoch (max_t), which would end the run before it recorded its result."""

    def __init__(self, run_id: str, trial_id: str, last_epoch: int, *, hold_at=frozenset(),
                 clock: str | None = None, chosen_by: str | None = None) -> None:  # fmt: skip
        self.run_id, self.trial_id, self.last_epoch = run_id, trial_id, last_epoch
        self.hold_at, self.clock, self.chosen_by = hold_at, clock, chosen_by
        self.last: dict[str, Any] | None = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        report = dict(metrics[0])
        epoch = report.get("epoch", 0)
        if checkpoint:
            report["checkpoint_path"] = checkpoint.path  # as TuneReportCallback names it
        if self.clock and epoch in self.hold_at:
            report[self.clock] = epoch
        if self.chosen_by:
            report["chosen_by"] = self.chosen_by
        if epoch in self.hold_at and checkpoint:
            source = {"run_id": self.run_id, "trial_id": self.trial_id, "epoch": epoch}
            with _tune_checkpoint(checkpoint.path, source) as tune_checkpoint:
                tune.report(report, checkpoint=tune_checkpoint)
        elif epoch == self.last_epoch:
            self.last = report
        else:
            tune.report(report)

    def send_last(self, final: dict[str, Any]) -> None:
        """Report the held last epoch; or, when the run trained nothing (restarted after its
        last epoch: the driver died before Tune got that report), its `final` metrics."""
        last = self.last or (final if final.get("epoch") == self.last_epoch else None)
        if last is not None:
            tune.report({**last, **({"chosen_by": self.chosen_by} if self.chosen_by else {})})


def finished_metrics(storage: Path, run_id: str) -> dict[str, Any] | None:
    """The final metrics of run `run_id` if it has finished: a trial Tune starts again after
    its run finished (the driver died before Tune got the last report) only reports them."""
    record = registry.read(registry.runs_root(storage) / run_id) or {}
    return record.get("metrics") if record.get("status") == "finished" else None


def fit_in_actor(cfg, run_id: str, to_tune: ToTune, **fit_args: Any) -> None:
    """A trial's run trained in this actor (`driver.fit(in_process=True)`), reporting to Tune
    through `to_tune`; a run that has already finished only reports its final metrics."""
    if (final := finished_metrics(cfg.storage_path(), run_id)) is not None:
        to_tune.send_last(final)
        return
    run = driver.fit(
        cfg,
        out=None,
        register=False,  # only the sweep's best trial becomes a model version
        run_id=run_id,
        callbacks=[to_tune],
        in_process=True,
        **fit_args,
    )
    to_tune.send_last(run.metrics)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # same file system: no bytes copied
    except OSError:
        shutil.copy2(source, target)


@contextmanager
def _tune_checkpoint(train_checkpoint: str, source: dict[str, Any]) -> Iterator[tune.Checkpoint]:
    """A Tune checkpoint with the Train checkpoint's files (Tune copies it into the trial's
    directory, where it outlives the Train run's own checkpoint rotation) and its origin."""
    with tempfile.TemporaryDirectory(prefix="relay-pbt-") as tmp:
        for name in checkpoint.files(train_checkpoint):
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(Path(train_checkpoint) / name, Path(tmp) / name)
        (Path(tmp) / SOURCE).write_text(json.dumps(source))
        yield tune.Checkpoint.from_directory(tmp)


# --- the trial driver --------------------------------------------------------------------------


def segments(storage: Path, sweep_id: str, trial_id: str) -> list[str]:
    """The Train runs of a trial, in order: `<sweep>-<trial>`, then `-p1`, `-p2`, ..."""
    root, first = registry.runs_root(storage), f"{sweep_id}-{trial_id}"
    found = [first] if (root / first).is_dir() else []
    for n in itertools.count(1):
        if not (root / f"{first}-p{n}").is_dir():
            return found
        found.append(f"{first}-p{n}")
    return found  # unreachable; for type checkers


def _segment(
    storage: Path,
    sweep_id: str,
    trial_id: str,
    given: tune.Checkpoint | None,
    params: dict[str, Any] | None = None,
) -> tuple[str, str | None, dict[str, Any]]:
    """(run id, checkpoint it starts from, `pbt` label) for this start of the trial."""
    runs = segments(storage, sweep_id, trial_id)
    if given is None:  # a new trial (or one resumed before it handed over any checkpoint)
        return f"{sweep_id}-{trial_id}", None, {}
    source = json.loads((Path(given.path) / SOURCE).read_text())
    if runs:
        current = runs[-1]
        record = registry.read(registry.runs_root(storage) / current) or {}
        label = record.get("pbt") or {}
        started_from_it = label.get("init_checkpoint") == given.path
        if source["run_id"] == current or (started_from_it and record.get("params") == params):
            # Its own checkpoint (a synchronous pause, a resumed sweep), or the exploit this
            # run was already started from, under the same config (a sweep resumed before the
            # run checkpointed): continue the run. The same checkpoint under a new config is a
            # new exploit.
            return current, label.get("init_checkpoint"), label
    n = max(1, len(runs))
    label = {
        "segment": n,
        "from_trial": source["trial_id"],
        "from_run": source["run_id"],
        "from_epoch": source["epoch"],
        "init_checkpoint": given.path,
    }
    return f"{sweep_id}-{trial_id}-p{n}", given.path, label


def trial_driver(
    params: dict[str, Any],
    *,
    base: dict[str, Any],
    sweep_id: str,
    hold_at: frozenset[int],
    chosen_by: str,
    clock: str | None = None,
    in_actor: bool = False,
    data=None,
) -> None:
    """One trial start whose run waits for Tune's decision at the epochs in `hold_at`: a PBT
    trial's `acting_epochs` (where PBT may exploit; `clock` TIME_ATTR reports them) or a
    promotion-based ASHA trial's rungs (where it may pause; promotion.py). Trains its run
    (from the checkpoint Tune hands over, if any) and reports each epoch to Tune, with a Tune
    checkpoint at each held epoch; `chosen_by` names what chose its config. `in_actor`: the run
    trains in this actor (sweep.trains_in_actor), else a TorchTrainer does.
    `data`: the sweep's split, put in the object store once (see sweep._trial_driver)."""
    cfg = trial_config(base, params["params"])
    trial_id = tune.get_context().get_trial_id()
    storage = cfg.storage_path()
    run_id, init, label = _segment(
        storage, sweep_id, trial_id, tune.get_checkpoint(), params["params"]
    )
    if label:
        chosen_by = f"pbt:exploit {label['from_trial']}"
    labels = {
        "sweep": sweep_id,
        "trial_id": trial_id,
        "params": params["params"],
        **({"pbt": label} if label else {}),
    }
    if in_actor:
        to_tune = ToTune(
            run_id, trial_id, cfg.epochs, hold_at=hold_at, clock=clock, chosen_by=chosen_by
        )
        fit_in_actor(cfg, run_id, to_tune, init_checkpoint=init, labels=labels, data=data)
        return
    _fit_with_mailbox(cfg, run_id, trial_id, init, labels, hold_at, chosen_by, clock, data)


def _fit_with_mailbox(cfg, run_id, trial_id, init, labels, hold_at, chosen_by, clock, data):
    """A TorchTrainer trial's run (trial_driver), fitted in a thread; its reports come from
    its controller through a mailbox and go to Tune from this thread (Tune's
    function-trainable thread)."""
    mailbox = Mailbox.remote()
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            driver.fit(
                cfg,
                out=None,
                register=False,
                run_id=run_id,
                init_checkpoint=init,
                callbacks=[_Forward(mailbox, hold_at)],
                labels=labels,
                data=data,
            )
        except BaseException as exc:  # raised again in the driver's thread, for Tune
            failure.append(exc)
        finally:
            mailbox.put.remote(None, False)

    thread = threading.Thread(target=fit, name="relay-pbt-fit", daemon=True)
    thread.start()
    while (item := ray.get(mailbox.get.remote())) is not None:
        metrics, path, hold = item
        epoch = metrics.get("epoch", 0)
        if clock and epoch in hold_at:
            metrics[clock] = epoch
        metrics["chosen_by"] = chosen_by
        if hold and path:
            source = {"run_id": run_id, "trial_id": trial_id, "epoch": epoch}
            with _tune_checkpoint(path, source) as tune_checkpoint:
                tune.report(metrics, checkpoint=tune_checkpoint)
        else:
            tune.report(metrics)
        if hold:  # Tune decided to continue this trial (a stop ends this thread in report)
            mailbox.go_on.remote()
    thread.join()
    if failure:
        raise failure[0]


# --- the sweep's record ------------------------------------------------------------------------


def add_lineage(cfg: SweepConfig, storage: Path, sweep_id: str, trials: list[dict]) -> None:
    """Give each trial summary its chain of runs (`segments`), make its last run the trial's
    `run_id` and score the trial by that run (the run whose checkpoint would be registered),
    and record superseded runs as stopped by PBT: they end mid-run, from outside."""
    root = registry.runs_root(storage)
    sign = 1 if cfg.mode == "max" else -1
    for trial in trials:
        runs = segments(storage, sweep_id, trial["trial_id"])
        if not runs:
            continue
        chain = []
        for run_id, successor in itertools.zip_longest(runs, runs[1:]):
            record = registry.read(root / run_id) or {}
            epochs = [e["epoch"] for e in history.read(root / run_id)]
            label = record.get("pbt") or {}
            chain.append(
                {
                    "run_id": run_id,
                    "from_trial": label.get("from_trial"),
                    "from_epoch": label.get("from_epoch"),
                    "epochs": [min(epochs), max(epochs)] if epochs else None,
                    "config": record.get("params"),
                }
            )
            if successor and record and record.get("status") != "stopped":
                record.pop("error", None)
                registry.write(
                    root / run_id,
                    {**record, "status": "stopped", "stopped_by": "pbt", "continued_in": successor},
                )
        trial["run_id"], trial["segments"] = runs[-1], chain
        scores = [e[cfg.metric] for e in history.read(root / runs[-1]) if cfg.metric in e]
        if scores:
            trial["best_score"] = sign * max(sign * s for s in scores)


def check_capacity(cfg: SweepConfig, fits: int) -> None:
    """The whole population must train at once (PBT compares and copies between live trials;
    a trial waiting for resources would hold the others at the interval)."""
    from relay.config import ConfigError

    if fits < cfg.population:
        raise ConfigError(
            f"num_samples: search_alg pbt trains its population of {cfg.population} at once, and "
            f"the cluster's free resources hold {fits} trials of "
            f"{cfg.train.scaling.describe()}: lower num_samples, or train.scaling."
            "resources_per_worker (e.g. {CPU: 0.5})"
        )
