"""The sweep configuration: the run config it trains, the searched fields, the search algorithm,
ASHA and PBT; and each trial's run config."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from relay.config.base import ConfigError, Section, error_lines, name_field
from relay.config.overrides import apply_overrides, read_yaml, set_dotted
from relay.config.run import (
    RunConfig,
    from_dict,
)

Distribution = Literal["choice", "grid", "uniform", "loguniform", "randint"]


class SearchDimension(Section):
    """One searched field: exactly one of the keys below."""

    choice: list[Any] | None = Field(None, min_length=1, description="Sample one of these.")
    grid: list[Any] | None = Field(None, min_length=1, description="Try every one of these.")
    uniform: tuple[float, float] | None = Field(None, description="[low, high], uniform.")
    loguniform: tuple[float, float] | None = Field(
        None, description="[low, high], uniform in log space (both > 0)."
    )
    randint: tuple[int, int] | None = Field(None, description="[low, high): an integer.")

    @model_validator(mode="after")
    def _exactly_one(self) -> SearchDimension:
        given = [name for name in get_args(Distribution) if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(get_args(Distribution))}")
        kind = given[0]
        if kind in ("uniform", "loguniform", "randint"):
            low, high = getattr(self, kind)
            if not low < high:
                raise ValueError(f"{kind}: low ({low}) must be below high ({high})")
            if kind == "loguniform" and low <= 0:
                raise ValueError("loguniform: bounds must be > 0")
        return self

    @property
    def kind(self) -> Distribution:
        return next(n for n in get_args(Distribution) if getattr(self, n) is not None)

    def probe_values(self) -> list[Any]:
        """Values that stand for the whole dimension when checking it against the config."""
        if self.kind in ("choice", "grid"):
            return list(getattr(self, self.kind))
        low, high = getattr(self, self.kind)
        return [low, high - 1] if self.kind == "randint" else [low, high]


class AshaConfig(Section):
    enabled: bool = Field(True, description="Stop weak trials early; false runs every trial out.")
    max_t: int | None = Field(
        None,
        ge=1,
        description="Epochs a trial may run at most. Always `train.epochs`, the one place to set "
        "a trial's length: leave it null (filled from `train.epochs`); a value that differs "
        "is an error.",
    )
    grace_period: int = Field(1, ge=1, description="Epochs every trial runs before it may stop.")
    reduction_factor: float = Field(
        2.0, gt=1, description="Keep the best 1/reduction_factor of trials at each rung."
    )
    strategy: Literal["stop", "promote"] = Field(
        "stop",
        description="stop: Ray's ASHAScheduler — a trial reaching a rung goes on if it ranks in "
        "the top 1/reduction_factor of the results recorded there so far, else stops (the "
        "first to arrive always goes on). promote: ASHA as published — a trial pauses at each "
        "rung unless it ranks in the rung's top 1/reduction_factor, and a free slot resumes the "
        "best paused trial that has become promotable, else starts a new one; each resume "
        "costs one run start-up (promotion.py).",
    )


SearchAlgorithm = Literal["random", "grid", "tpe", "pbt"]


class PbtConfig(Section):
    """Population Based Training (`search_alg: pbt`): every `interval` epochs the weaker
    trials copy a stronger trial's checkpoint (weights and optimizer) and perturb its
    hyperparameters (the `search` fields)."""

    interval: int = Field(
        2, ge=1, description="Epochs between exploit/explore steps (PBT's perturbation interval)."
    )
    quantile_fraction: float = Field(
        0.25,
        gt=0,
        le=0.5,
        description="The bottom fraction of trials copies from the top fraction.",
    )
    resample_probability: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Chance that an explored field is drawn afresh from its search "
        "distribution instead of perturbed (a number multiplied by 0.8 or 1.2, a choice moved "
        "to a neighbouring value); perturbed numbers stay within their search bounds.",
    )
    synch: bool = Field(
        True,
        description="true: the population waits at every interval until all its trials "
        "reached it, so each exploit compares the whole population (each trial's Train run "
        "restarts there: a start-up per trial per interval); false: each trial decides when "
        "it arrives, against the scores the others last reported (no waiting, no restart of "
        "a continuing trial, but early arrivals have few trials to compare with).",
    )


# Fields a PBT exploit cannot change: the donor's checkpoint must fit the trial's model and
# optimizer, and every trial runs the sweep's whole length (`train.epochs`).
PBT_FIXED_FIELDS = ("task", "size", "model", "epochs", "optim.name")


class SweepConfig(BaseModel):
    # No validate_assignment here: the validator below fills fields in, and re-validating the
    # whole sweep on each of those assignments would run the validator again.
    model_config = ConfigDict(extra="forbid")

    name: str = name_field("sweep", "Sweep")
    train: RunConfig = Field(
        ..., description="The train config every trial starts from (a mapping, or a YAML path)."
    )
    search: dict[str, SearchDimension] = Field(
        ..., min_length=1, description="Dotted train-config field → distribution."
    )
    num_samples: int = Field(8, ge=1, description="Trials sampled (× the grid's combinations).")
    seed: int | None = Field(
        None,
        ge=0,
        description="Seeds the search's draws: the same seed samples the same trial configs in "
        "the same order (pbt: and the same exploit/explore draws); null: fresh draws every sweep.",
    )
    metric: str | None = Field(None, description="Metric to optimise; null: the task's metric.")
    mode: Literal["min", "max"] | None = Field(None, description="null: the task's mode.")
    search_alg: SearchAlgorithm = Field(
        "random",
        description="How trial configs are chosen: random (and grid) draws, tpe (Optuna's "
        "Tree-structured Parzen Estimator, learning from finished trials; with ASHA), or pbt "
        "(Population Based Training; replaces ASHA).",
    )
    asha: AshaConfig = Field(default_factory=AshaConfig, description="ASHA early stopping.")
    pbt: PbtConfig = Field(default_factory=PbtConfig, description="Used when search_alg is pbt.")
    workers_per_trial: int | None = Field(
        None, ge=1, description="DDP workers of each trial; null: train.scaling.num_workers."
    )
    max_concurrent_trials: int | None = Field(
        None,
        ge=1,
        description="null: as many as the cluster's free CPUs/GPUs hold at once, plus `overlap`.",
    )
    overlap: int = Field(
        0,
        ge=0,
        description="Trials started beyond what the free CPUs/GPUs hold (max_concurrent_trials "
        "null; not pbt): each prepares its driver, controller and data while others train, and "
        "its workers start when a running trial ends.",
    )
    in_actor: bool = Field(
        True,
        description="Trials of one worker (object-store data, no memory limit, whole "
        "checkpoints) train inside their Tune trial's actor, reused from trial to trial, "
        "instead of a worker group of their own; false: every trial is a TorchTrainer run.",
    )
    model_name: str | None = Field(
        None, description="Register the best trial under this model; null: the task's name."
    )

    @model_validator(mode="after")
    def _fit_train(self) -> SweepConfig:
        if self.workers_per_trial is not None:
            self.train.scaling.num_workers = self.workers_per_trial
        self.metric = self.metric or self.train.checkpoint.metric
        self.mode = self.mode or self.train.checkpoint.mode
        # A sweep's clocks (ASHA rungs, PBT intervals, Tune's iterations) count epochs.
        for field, value in (
            ("train.max_steps", self.train.max_steps),
            ("train.checkpoint.every_steps", self.train.checkpoint.every_steps),
            ("train.checkpoint.every_minutes", self.train.checkpoint.every_minutes),
            ("train.validation.every_steps", self.train.validation.every_steps),
            ("train.report.every_steps", self.train.report.every_steps),
        ):
            if value is not None:
                raise ValueError(f"{field}: sweeps count epochs; set train.epochs instead")
        # `train.epochs` alone sets how long a trial may train (ASHA decides how many of those
        # epochs each trial gets): a `--set train.epochs=N` must never be silently outvoted.
        epochs = self.train.epochs
        if self.asha.max_t is not None and self.asha.max_t != epochs:
            raise ValueError(
                f"asha.max_t: {self.asha.max_t} contradicts train.epochs ({epochs}); a trial's "
                "length is train.epochs alone: set that, and leave asha.max_t unset"
            )
        self.asha.max_t = epochs
        if self.asha.grace_period > epochs:
            raise ValueError(f"asha.grace_period: must be <= train.epochs ({epochs})")
        base = self.train.model_dump(mode="json", exclude_defaults=False)
        for key, dimension in self.search.items():
            for value in dimension.probe_values():
                try:
                    trial_config(base, {key: value})
                except ConfigError as exc:
                    raise ValueError(f"search.{key}: {value!r} does not fit: {exc}") from None
        return self

    @model_validator(mode="after")
    def _fit_search_alg(self) -> SweepConfig:
        """Each search algorithm takes only the dimensions it can use: grid enumerates, so
        every field must be a list (grid or choice); TPE samples, so no field may be a grid."""
        if self.search_alg == "grid":
            for key, dimension in self.search.items():
                if dimension.kind not in ("grid", "choice"):
                    raise ValueError(
                        f"search.{key}: search_alg grid tries every combination, and "
                        f"{dimension.kind} cannot be enumerated: give grid: [...] or choice: [...]"
                    )
            # Each combination once unless asked: repeats of a grid rerun identical configs.
            if "num_samples" not in self.model_fields_set:
                self.num_samples = 1
        elif self.search_alg == "tpe":
            for key, dimension in self.search.items():
                if dimension.kind == "grid":
                    raise ValueError(
                        f"search.{key}: search_alg tpe samples every field and cannot run a "
                        "grid: use choice: [...] (or search_alg grid)"
                    )
            try:
                import optuna  # noqa: F401  (only whether it imports matters here)
            except ImportError:
                raise ValueError(
                    "search_alg: tpe needs Optuna, which is not installed: "
                    "pip install 'relay[optuna]'"
                ) from None
        return self

    @property
    def population(self) -> int:
        """Trials the sweep creates: num_samples for each combination of the grid fields."""
        grids = [len(d.grid) for d in self.search.values() if d.grid is not None]
        return self.num_samples * math.prod(grids)

    @model_validator(mode="after")
    def _fit_pbt(self) -> SweepConfig:
        if self.search_alg != "pbt":
            return self
        for key in self.search:
            if key in PBT_FIXED_FIELDS or key.startswith("model."):
                raise ValueError(
                    f"search.{key}: search_alg pbt copies checkpoints between trials, so every "
                    "trial keeps the same task, size, model, epochs and optimizer: set it in "
                    "train, not in search"
                )
        if "asha" in self.model_fields_set and self.asha.enabled:
            raise ValueError(
                "asha.enabled: search_alg pbt replaces ASHA (weak trials copy strong ones "
                "instead of stopping): set asha.enabled false, or leave asha out"
            )
        # Left out: off, as the saved sweep.json then says (and `--resume` reads back).
        self.asha.enabled = False
        if self.population < 2:
            raise ValueError("num_samples: search_alg pbt needs a population of at least 2")
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < (
            self.population
        ):
            raise ValueError(
                f"max_concurrent_trials: search_alg pbt trains its whole population at once: "
                f"must be >= {self.population} (num_samples x grid combinations)"
            )
        epochs, every = self.train.epochs, self.train.checkpoint.every
        if self.pbt.interval >= epochs:
            raise ValueError(
                f"pbt.interval: must be below train.epochs ({epochs}): PBT acts every interval "
                "epochs and never at the last"
            )
        if self.pbt.interval % every:
            raise ValueError(
                f"pbt.interval: must be a multiple of train.checkpoint.every ({every}): a trial "
                "hands over the checkpoint of the epoch it reached"
            )
        return self


def trial_config(base: dict[str, Any], params: dict[str, Any]) -> RunConfig:
    """The train config of one trial: the sweep's base with the sampled `params` set."""
    import copy

    data = copy.deepcopy(base)
    for key, value in params.items():
        set_dotted(data, key.split("."), value)
    return from_dict(data)


def load_sweep(path: str | os.PathLike[str], overrides: list[str] = ()) -> SweepConfig:
    """Read a sweep YAML; `train:` may be a path to a train config (relative to the sweep)."""
    data = read_yaml(path)
    if isinstance(data.get("train"), str):
        train_path = Path(path).parent / data["train"]
        data["train"] = read_yaml(train_path)
    return sweep_from_dict(apply_overrides(data, list(overrides)))


def sweep_from_dict(data: dict[str, Any]) -> SweepConfig:
    try:
        return SweepConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(error_lines(exc))) from None
