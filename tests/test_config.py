"""Config validation: bad configs fail with exit code 2, name the field, and never start Ray."""

from __future__ import annotations

import pytest
from support import REPO, cli_in_fresh_interpreter

from relay import config
from relay.config import ConfigError

pytestmark = pytest.mark.timeout(120)

DIGITS = REPO / "jobs" / "configs" / "digits.yaml"
SWEEP = REPO / "jobs" / "configs" / "digits-sweep.yaml"


def test_example_configs_load():
    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        sweep = path.stem.endswith("-sweep")
        cfg = config.load_sweep(path).train if sweep else config.load(path)
        assert cfg.storage_path().is_absolute()
        assert cfg.checkpoint.metric and cfg.checkpoint.mode


def test_overrides_are_typed_and_nested():
    cfg = config.load(DIGITS, ["optim.lr=0.05", "scaling.num_workers=3", "model.hidden=[8]"])
    assert cfg.optim.lr == 0.05
    assert cfg.scaling.num_workers == 3
    assert cfg.model == {"hidden": [8]}


def test_task_defaults_fill_checkpoint_metric():
    cfg = config.load(None, ["task=charlm"])
    assert (cfg.checkpoint.metric, cfg.checkpoint.mode) == ("val_loss", "min")


def test_parallel_section_and_elastic_workers():
    cfg = config.load(
        DIGITS,
        ["parallel.strategy=fsdp", "parallel.mixed_precision=bf16", "parallel.grad_accum=4",
         "scaling.num_workers=[1, 4]"],
    )  # fmt: skip
    assert cfg.parallel.strategy == "fsdp" and cfg.parallel.grad_accum == 4
    assert cfg.scaling.num_workers == (1, 4) and cfg.scaling.elastic
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 4)
    assert cfg.scaling.describe() == "1-4 workers (elastic)"
    fixed = config.load(DIGITS, ["scaling.num_workers=3"]).scaling
    assert not fixed.elastic and fixed.min_workers == fixed.max_workers == 3
    assert config.load(DIGITS).parallel.strategy == "ddp"  # the default changes nothing


def test_storage_defaults_to_absolute_relay_home(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    assert config.load(DIGITS).storage_path() == tmp_path / "home"
    monkeypatch.delenv("RELAY_HOME")
    assert config.load(DIGITS).storage_path().is_absolute()


def test_train_epochs_alone_sets_the_length_of_a_sweep_trial():
    """`--set train.epochs=N` reaches every trial and ASHA's max_t (it used to be overwritten
    by asha.max_t); an asha.max_t that disagrees is refused, naming the field."""
    cfg = config.load_sweep(SWEEP, ["train.epochs=3"])
    assert (cfg.train.epochs, cfg.asha.max_t) == (3, 3)
    trial = config.trial_config(cfg.train.model_dump(mode="json"), {"optim.lr": 0.01})
    assert trial.epochs == 3
    assert config.load_sweep(SWEEP).asha.max_t == config.load(DIGITS).epochs
    assert config.load_sweep(SWEEP, ["train.epochs=4", "asha.max_t=4"]).asha.max_t == 4
    for overrides, message in [
        (["asha.max_t=4"], "asha.max_t: 4 contradicts train.epochs (10)"),
        (["train.epochs=3", "asha.max_t=10"], "asha.max_t: 10 contradicts train.epochs (3)"),
        (["train.epochs=3", "asha.grace_period=4"], "asha.grace_period: must be <= train"),
    ]:
        with pytest.raises(ConfigError) as info:
            config.load_sweep(SWEEP, overrides)
        assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["optim.lr=-1"], "optim.lr"),
        (["optim.lrr=0.1"], "optim.lrr"),
        (["epochs=ten"], "epochs"),
        (["scaling.num_workers=0"], "scaling.num_workers"),
        (["task=nope"], "task"),
        (["size=huge"], "size"),
        (["model.hidden=oops"], "model.hidden"),
        (["model.layers=3"], "model.layers"),
        (["data.path=/tmp/x"], "data.path"),
        (["optim=3"], "optim"),
        (["scaling.num_workers=[3, 2]"], "scaling.num_workers"),
        (["scaling.num_workers=[0, 2]"], "scaling.num_workers"),
        (["scaling.num_workers=[1, 2, 3]"], "scaling.num_workers"),
        (["parallel.strategy=zero3"], "parallel.strategy"),
        (["parallel.mixed_precision=fp8"], "parallel.mixed_precision"),
        (["parallel.grad_accum=0"], "parallel.grad_accum"),
        (["parallel.strategy=fsdp", "parallel.mixed_precision=fp16"], "parallel.mixed_precision"),
        (["parallel.compile=maybe"], "parallel.compile"),
        (["parallel.sharding=2"], "parallel.sharding"),
        (["max_steps=0"], "max_steps"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
        # Where a stream of files stands mid-epoch is not recorded: no step clock over it.
        (["checkpoint.every_steps=5", "data.cache=false"], "checkpoint.every_steps"),
        (["checkpoint.every_minutes=0"], "checkpoint.every_minutes"),
        (["checkpoint.every_minutes=30", "data.cache=false"], "checkpoint.every_minutes"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        config.load(DIGITS, overrides)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_cli_rejects_bad_configs_before_ray(tmp_path):
    files = {
        "unknown_key": "task: digits\nepochz: 3\n",
        "wrong_type": "task: digits\nbatch_size: [64]\n",
        "bad_value": "task: digits\ncheckpoint: {every: 0}\n",
        "invalid_yaml": "task: digits\noptim: {lr: 0.1\n",
        "not_a_mapping": "- task\n- digits\n",
    }
    cases = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        cases[name] = ["train", str(path)]
    cases["missing_file"] = ["train", str(tmp_path / "absent.yaml")]
    cases["bad_set"] = ["train", str(REPO / "jobs/configs/digits.yaml"), "--set", "optim.lr"]
    cases["bad_set_value"] = ["train", str(DIGITS), "--set", "scaling.use_gpu=maybe"]
    cases["tune_max_t"] = ["tune", str(SWEEP), "--set", "asha.max_t=6"]
    old_style = tmp_path / "old-style-sweep.yaml"  # max_t pinned in the file, epochs overridden
    old_style.write_text(SWEEP.read_text().replace("asha: {", "asha: {max_t: 10, "))
    old_style.with_name("digits.yaml").write_text(DIGITS.read_text())
    cases["tune_epochs_vs_max_t"] = ["tune", str(old_style), "--set", "train.epochs=6"]
    # In a fresh interpreter, so we can also see that Ray was never imported (let alone started)
    # before the config was rejected.
    results = cli_in_fresh_interpreter(cases)
    expect_in_message = {
        "unknown_key": "epochz: unknown field",
        "wrong_type": "batch_size:",
        "bad_value": "checkpoint.every:",
        "invalid_yaml": "invalid YAML",
        "not_a_mapping": "must be a mapping",
        "missing_file": "cannot read config file",
        "bad_set": "expected dotted.key=value",
        "bad_set_value": "scaling.use_gpu:",
        "tune_max_t": "asha.max_t: 6 contradicts train.epochs (10)",
        "tune_epochs_vs_max_t": "asha.max_t: 10 contradicts train.epochs (6)",
    }
    for name, fragment in expect_in_message.items():
        assert results[name]["code"] == 2, (name, results[name])
        assert fragment in results[name]["stderr"], (name, results[name]["stderr"])
    assert results["ray_imported"] is False


def test_config_reference_in_docs_is_current():
    from relay.config.reference import config_reference

    page = (REPO / "docs" / "config-reference.md").read_text()
    assert config_reference() in page, (
        "docs/config-reference.md is stale: paste in what `relay reference` prints"
    )


def test_search_alg_takes_only_the_fields_it_can_use():
    """grid enumerates (every field a grid or choice), tpe samples (no grid); each refusal
    names the field. A grid sweep runs each combination once unless num_samples is given."""
    lr_grid = "search={optim.lr: {grid: [0.1, 0.01]}, batch_size: {choice: [32, 64]}}"
    for overrides, message in [
        (["search_alg=grid"], "search.optim.lr: search_alg grid tries every combination, and "
         "loguniform cannot be enumerated"),
        (["search_alg=tpe", lr_grid], "search.optim.lr: search_alg tpe samples every field and "
         "cannot run a grid"),
        (["search_alg=annealing"], "search_alg:"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            config.load_sweep(SWEEP, overrides)
        assert str(info.value).startswith(message), str(info.value)
    assert config.load_sweep(SWEEP, ["search_alg=tpe"]).search_alg == "tpe"
    assert config.load_sweep(SWEEP, ["search_alg=grid", lr_grid]).num_samples == 8  # the file's
    spec = config.load_sweep(SWEEP, ["search_alg=grid", lr_grid]).model_dump(mode="json")
    del spec["num_samples"]
    assert config.sweep_from_dict(spec).num_samples == 1


def test_tpe_without_optuna_fails_with_the_install_line(tmp_path):
    """Where Optuna is not installed (a plain `pip install relay`), `search_alg: tpe` is refused
    at validation — a new sweep before Ray is imported, a resumed one before Ray starts —
    with one line naming search_alg and the extra to install; exit 2."""
    import json
    import subprocess
    import sys
    import textwrap

    from support import subprocess_env

    sweep_id = "tpe-sweep"
    storage = tmp_path / "storage"
    (storage / "sweeps" / sweep_id).mkdir(parents=True)
    saved = config.load_sweep(SWEEP, ["search_alg=tpe"])  # saved where Optuna was installed
    (storage / "sweeps" / sweep_id / "sweep.json").write_text(saved.model_dump_json())
    probe = textwrap.dedent(
        """
        import contextlib, io, json, sys
        sys.modules["optuna"] = None  # what `import optuna` meets where it is not installed
        from relay.cli import main
        results = []
        for argv in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            results.append({"code": code, "stderr": err.getvalue(), "ray": "ray" in sys.modules})
        print(json.dumps(results))
        """
    )
    cases = [
        ["tune", str(SWEEP), "--set", "search_alg=tpe"],
        ["tune", "--resume", sweep_id, "--storage", str(storage)],
    ]
    out = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(cases)],
        env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    new, resumed = json.loads(out.stdout.strip().splitlines()[-1])
    line = "search_alg: tpe needs Optuna, which is not installed: pip install 'relay[optuna]'"
    for result in (new, resumed):
        assert result["code"] == 2, result
        assert line in result["stderr"] and "Traceback" not in result["stderr"], result
    assert new["ray"] is False


@pytest.mark.parametrize(
    "field",
    [
        "train.max_steps=50",
        "train.checkpoint.every_steps=5",
        "train.checkpoint.every_minutes=30",
        "train.validation.every_steps=5",
        "train.report.every_steps=5",
    ],
)
def test_sweeps_refuse_step_clocks(field):
    # A sweep's rungs and PBT intervals count epochs.
    with pytest.raises(ConfigError) as info:
        config.load_sweep(SWEEP, [field])
    assert str(info.value).startswith(f"{field.split('=')[0]}: sweeps count epochs"), info.value
