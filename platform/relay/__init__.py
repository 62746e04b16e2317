"""relay: train, tune and serve PyTorch models on one Ray cluster.

import relay
cfg = relay.load_config("jobs/configs/digits.yaml", ["epochs=3"])
result = relay.train(cfg)   # ray.init() is done for you if nobody has
sweep = relay.tune(relay.load_sweep_config("jobs/configs/digits-sweep.yaml"))
served = relay.serve(["digits:best"], port=8000)   # returns once it answers; served.stop()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relay.version import __version__

if TYPE_CHECKING:
    from relay.config import RunConfig, SweepConfig
    from relay.serving.served import Served
    from relay.training.driver import RunResult
    from relay.tuning.sweep import SweepResult

__all__ = ["__version__", "load_config", "load_sweep_config", "serve", "train", "tune"]


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Load and validate a run config (YAML file plus `dotted.key=value` overrides)."""
    from relay.config import load

    return load(path, overrides)


def load_sweep_config(path: str, overrides: list[str] = ()) -> SweepConfig:
    """Load and validate a sweep config (YAML file plus `dotted.key=value` overrides); its
    `train:` may name a run config file, relative to the sweep's."""
    from relay.config import load_sweep

    return load_sweep(path, overrides)


def train(cfg: RunConfig | dict[str, Any], **kwargs: Any) -> RunResult:
    """Train on the current Ray cluster, or an embedded local one; returns the run's result
    (run id, best checkpoint, registered model version, history). See
    relay.training.driver.fit for the keyword arguments.

        import relay
        cfg = relay.load_config("jobs/configs/digits.yaml", ["epochs=2"])
        result = relay.train(cfg)
        print(result.run_id, result.model)   # e.g. digits-1a2b3c4d digits:1
    """
    from relay.config import RunConfig, from_dict

    cfg = cfg if isinstance(cfg, RunConfig) else from_dict(cfg)
    from relay.training.driver import fit  # Ray: only once the config is good

    return fit(cfg, **kwargs)


def tune(sweep: SweepConfig | dict[str, Any], **kwargs: Any) -> SweepResult:
    """Sweep hyperparameters over the same train loop (Ray Tune: random, grid, TPE or PBT
    search, ASHA stopping) on the current Ray cluster, or an embedded local one; registers the
    best trial as a model version. See relay.tuning.sweep.run for the keyword arguments
    (`resume=<sweep id>` continues an interrupted sweep).

        import relay
        sweep = relay.load_sweep_config("jobs/configs/digits-sweep.yaml", ["num_samples=2"])
        result = relay.tune(sweep)
        print(result.sweep, result.best["config"], result.model)
    """
    from relay.config import SweepConfig, sweep_from_dict

    cfg = sweep if isinstance(sweep, SweepConfig) else sweep_from_dict(sweep)
    from relay.tuning import sweep as sweeps  # Ray Tune: only once the config is good

    return sweeps.run(cfg, **kwargs)


def serve(
    refs: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    allow_task: Sequence[str] = (),
    **options: Any,
) -> Served:
    """Serve models over HTTP (Ray Serve; KServe v1 and v2, relay's app) from the current Ray
    cluster, or from one started here that stops with the handle; returns once every model
    answers, without blocking. `refs`: each name:best, name:latest, name:N, a run id or a
    checkpoint directory; `options`: the `relay serve` flags as keywords (replicas, num_cpus,
    max_batch_size, storage, ...: relay.serving.args.AppArgs). A bad option or reference
    raises ConfigError naming it before any cluster work; `allow_task` as `--allow-task`.

        import relay, requests
        with relay.serve(["digits:best"], port=8000) as served:
            answer = requests.post(f"{served.url}/v1/models/digits:predict",
                                   json={"instances": [[0.0] * 64]})
            print(answer.json()["predictions"])
    """
    from relay.serving.served import app_args, start

    return start(app_args(refs, options), allow_task, host, port)
