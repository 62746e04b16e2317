"""`relay plan`: memory per rank, measured from the real model (in-process, CPU, no Ray) — and
checked against what a real `parallel.Engine` holds at 1 and 2 workers (the one test here that
starts a Train run)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
from support import BIN, REPO, subprocess_env

from relay import config
from relay.cli import main
from relay.tasks import build_task
from relay.training.plan import parse_bytes

CHARLM = "jobs/configs/charlm.yaml"
DIGITS = "jobs/configs/digits.yaml"
REGRESSION = "jobs/configs/regression.yaml"


def plan_json(path: str, *args: str) -> dict:
    """`relay plan PATH ARGS --json`, run in this process: the one JSON object it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", path, "--set", "size=debug", *args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [CHARLM, DIGITS])
def test_model_state_is_the_real_models(path):
    report = plan_json(path, "--workers", "2")
    cfg = config.load(path, ["size=debug"])
    model = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path).build_model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    assert report["model"]["parameters"] == numel
    assert report["model"]["param_bytes"] == 4 * numel
    assert report["model"]["grad_bytes"] == 4 * numel
    # AdamW: exp_avg and exp_avg_sq in fp32 per parameter, and a float32 step per tensor.
    assert report["model"]["optimizer_bytes"] == 2 * 4 * numel + 4 * len(params)
    assert report["strategies"]["ddp"]["param_bytes"] == 4 * numel
    assert report["strategies"] == report["precisions"]["none"]
    assert set(report["strategies"]) == {"ddp", "zero1", "fsdp"}
    if cfg.task == "charlm":  # the tied head is one parameter with the embedding
        every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        assert numel < every


# --- the plan against what a real parallel.Engine holds ----------------------------------------

# Models whose layouts differ: charlm's transformer blocks (FSDP units; tied embedding and head;
# every first dimension even) and regression's MLP (its 1-output layer has a single row, which
# FSDP2 pads to one row per rank, and ZeroRedundancyOptimizer's partition is lopsided: the
# 32x8 weight alone on one rank).
ENGINE_CASES = {
    "charlm": (CHARLM, ["size=debug", "model.n_layer=2", "model.dropout=0.0"]),
    "regression": (REGRESSION, ["size=debug"]),
}
# Activations are measured (at 2 workers) with a batch whose tensors are mostly over 64 KiB,
# which the measurement sees exactly (see efficiency.activation_bytes); regression's are tiny.
ACTIVATION_ROWS = {"charlm": 256}
# (strategy, precision): bf16 checks the plan's "fp32 master weights, gradients and optimizer
# state under mixed precision" against FSDP2's MixedPrecisionPolicy, the one that casts.
ENGINE_VARIANTS = [("ddp", "none"), ("zero1", "none"), ("fsdp", "none"), ("fsdp", "bf16")]


def _engine_footprints(loop_config: dict) -> dict | None:
    """On every rank: each case's model in a real `parallel.Engine` under each variant, one
    real optimizer step on real rows, then the bytes its parameters, gradients and optimizer
    state occupy (relay.training.footprint: live storages, each once). Rank 0 returns every
    rank's."""
    import torch

    from relay import config, parallel
    from relay.config import ParallelConfig
    from relay.tasks import build_task
    from relay.training import efficiency, footprint
    from relay.training.epochs import optimizer_spec

    torch.set_num_threads(1)
    out: dict = {}
    for case, (path, overrides) in loop_config["cases"].items():
        cfg = config.load(path, overrides)
        task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
        batch = task.first_rows(task.load_data(cfg.data.val_fraction, cfg.seed).train, 8)
        for strategy, precision in loop_config["variants"]:
            torch.manual_seed(cfg.seed)
            par = ParallelConfig(strategy=strategy, mixed_precision=precision)
            engine = parallel.Engine(task.build_model(), par, *optimizer_spec(cfg.optim))
            engine.zero_grad()
            with engine.micro_step():
                engine.backward(task.loss_and_stats(engine.model, batch)[0])
            engine.step()  # optimizers create their state on the first step
            measured = footprint.state_bytes(engine.model, engine.optimizer)
            rows = loop_config.get("activation_rows", {}).get(case)
            if rows:  # in Ray's worker processes only: it changes glibc's settings for good
                big = task.first_rows(task.load_data(cfg.data.val_fraction, cfg.seed).train, rows)
                measured["activation_bytes"] = efficiency.activation_bytes(
                    engine, lambda t=task, e=engine, b=big: t.loss_and_stats(e.model, b)[0]
                )
            out[f"{case}/{strategy}/{precision}"] = parallel.gather_objects(measured)
    return out if parallel.is_main() else None


def _fit_on_workers(workers: int, tmp_path) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    cases = {name: (str(REPO / path), sets) for name, (path, sets) in ENGINE_CASES.items()}
    trainer = TorchTrainer(
        _engine_footprints,
        train_loop_config={
            "cases": cases,
            "variants": ENGINE_VARIANTS,
            "activation_rows": ACTIVATION_ROWS,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers, resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(name=f"footprints-{workers}", storage_path=str(tmp_path)),
    )
    return trainer.fit().return_value


@pytest.fixture(scope="module")
def engine_footprints(ray_cluster, tmp_path_factory) -> dict[int, dict]:
    """Footprints at 1 worker (in this process: no process group, world size 1, which is what
    the engine sees in a 1-worker run) and at 2 (a real 2-worker TorchTrainer group, gloo)."""
    import ray.cloudpickle
    import torch

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests
    cases = {name: (str(REPO / path), sets) for name, (path, sets) in ENGINE_CASES.items()}
    threads = torch.get_num_threads()
    try:
        single = _engine_footprints({"cases": cases, "variants": ENGINE_VARIANTS})
    finally:
        torch.set_num_threads(threads)  # the function pins 1 thread, as on a worker
    return {1: single, 2: _fit_on_workers(2, tmp_path_factory.mktemp("footprints"))}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_plan_matches_what_the_engine_holds(engine_footprints, case, workers):
    """The plan's bytes per rank equal, to the byte, what the fullest rank of a real engine
    holds after one optimizer step, for each strategy at 1 and 2 workers.

    Tolerance: none. The plan follows torch's own layouts (FSDP2 pads each parameter's rows
    to a multiple of the world size; ZeroRedundancyOptimizer partitions whole parameters
    greedily; DDP's buckets hold exactly the gradients; AdamW keeps an unsharded `step` per
    parameter), and on CPU a storage is exactly the bytes asked for: for a given model and
    world size every figure is deterministic, so a byte of difference is a discrepancy, not
    noise. Not compared: activations and fsdp's gathered parameters (transient: released by
    the time a step ends), which the plan estimates separately."""
    path, overrides = ENGINE_CASES[case]
    sets = [arg for o in overrides for arg in ("--set", o)]
    for strategy, precision in ENGINE_VARIANTS:
        measured = engine_footprints[workers][f"{case}/{strategy}/{precision}"]
        assert len(measured) == workers
        report = plan_json(path, *sets, "--workers", str(workers))
        planned = report["precisions"][precision][strategy]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            fullest = max(rank[key] for rank in measured)
            assert planned[key] == fullest, (case, strategy, precision, key, measured)
        if strategy == "ddp":  # an independent count: fp32, one value per distinct parameter
            cfg = config.load(path, overrides)
            model = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path).build_model()
            numel = sum(p.numel() for p in model.parameters())
            assert all(rank["param_bytes"] == 4 * numel for rank in measured)
    if workers == 2:  # sharding is real: fsdp's fullest rank holds about half of ddp's state
        fsdp = max(r["state_bytes"] for r in engine_footprints[2][f"{case}/fsdp/none"])
        ddp = max(r["state_bytes"] for r in engine_footprints[2][f"{case}/ddp/none"])
        assert fsdp < 0.6 * ddp, (fsdp, ddp)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planned_activations_are_what_a_real_forward_holds(engine_footprints):
    """The plan's activations (autograd's saved tensors, counted through saved-tensor hooks in
    the planning process) against the memory one forward really adds on each rank of a real
    2-worker engine (resident pages, counted by the kernel), under every strategy and in fp32
    and bf16. Tolerance 15%: the measurement misses blocks under 1 MiB (they reuse the heap)
    and counts whole pages. Under fsdp the forward also leaves the root's own parameters
    gathered (parallel/fsdp.py), in the compute dtype: counted here from the model itself."""
    path, overrides = ENGINE_CASES["charlm"]
    cfg = config.load(path, overrides)
    model = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path).build_model()
    root_numel = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    sets = [arg for o in overrides for arg in ("--set", o)]
    rows = ACTIVATION_ROWS["charlm"]
    report = plan_json(path, *sets, "--set", f"batch_size={rows}", "--workers", "2")
    for strategy, precision in ENGINE_VARIANTS:
        planned = report["precisions"][precision][strategy]["activation_bytes"]
        if strategy == "fsdp":
            planned += root_numel * (2 if precision == "bf16" else 4)
        assert planned > 8 << 20  # far above what the measurement can miss
        for rank in engine_footprints[2][f"charlm/{strategy}/{precision}"]:
            assert rank["activation_bytes"] == pytest.approx(planned, rel=0.15), (
                strategy,
                precision,
                rank["activation_bytes"],
                planned,
            )


@pytest.mark.timeout(120)
def test_activations_grow_linearly_with_batch_size():
    small = plan_json(CHARLM, "--set", "batch_size=32")
    large = plan_json(CHARLM, "--set", "batch_size=64")
    ratio = (
        large["strategies"]["ddp"]["activation_bytes"]
        / small["strategies"]["ddp"]["activation_bytes"]
    )
    assert 1.6 <= ratio <= 2.1, ratio
    assert small["activation_bytes_per_sample"] == large["activation_bytes_per_sample"] > 0


@pytest.mark.timeout(120)
def test_bf16_shrinks_activations_and_gathered_parameters():
    report = plan_json(CHARLM, "--workers", "2", "--set", "parallel.mixed_precision=bf16")
    fp32, bf16 = report["precisions"]["none"], report["precisions"]["bf16"]
    assert report["mixed_precision"] == "bf16"
    assert report["strategies"] == bf16
    # Measured under autocast: the saved tensors really are smaller. (State bytes under bf16
    # are checked against a real engine in test_plan_matches_what_the_engine_holds.)
    assert bf16["ddp"]["activation_bytes"] < fp32["ddp"]["activation_bytes"]
    # fp16 under fsdp is refused by the config, and the plan says so rather than sizing it.
    fp16 = report["precisions"]["fp16"]
    assert fp16["ddp"]["supported"] and not fp16["fsdp"]["supported"]
    assert fp16["fsdp"]["fits"] is False


@pytest.mark.timeout(120)
def test_activation_checkpointing_reduces_activations():
    deep = ("--set", "model.n_layer=4")
    plain = plan_json(CHARLM, *deep)
    checkpointed = plan_json(CHARLM, *deep, "--set", "parallel.activation_checkpointing=true")
    assert checkpointed["activation_checkpointing"] is True
    kept = checkpointed["strategies"]["ddp"]["activation_bytes"]
    assert kept < plain["strategies"]["ddp"]["activation_bytes"]
    assert kept == checkpointed["activation_bytes_with_checkpointing"]
    assert (
        plain["strategies"]["ddp"]["activation_bytes"]
        == (checkpointed["activation_bytes_without_checkpointing"])
    )


@pytest.mark.timeout(120)
def test_fits_against_device_memory(capsys):
    tiny = plan_json(DIGITS, "--device-memory", "1KiB")
    assert tiny["device_memory_bytes"] == 1024
    assert not any(entry["fits"] for entry in tiny["strategies"].values())
    huge = plan_json(DIGITS, "--device-memory", "1e15")
    assert all(entry["fits"] for entry in huge["strategies"].values())

    assert main(["plan", DIGITS, "--set", "size=debug", "--device-memory", "1KiB"]) == 0
    text = capsys.readouterr().out
    assert "nothing fits in 1.0 KiB" in text
    assert main(["plan", DIGITS, "--set", "size=debug", "--device-memory", "80GiB"]) == 0
    text = capsys.readouterr().out
    assert "fits in 80.0 GiB: ddp, zero1, fsdp" in text
    assert "optimizer state" in text and "activations" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1e9", 10**9)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.timeout(120)
def test_bad_flags_exit_2_naming_them(capsys):
    out = subprocess.run(
        [str(BIN / "relay"), "plan", CHARLM, "--device-memory", "80XB"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 2 and "--device-memory" in out.stderr, out.stderr
    assert main(["plan", CHARLM, "--device-memory=-5GiB"]) == 2
    assert "--device-memory" in capsys.readouterr().err
    assert main(["plan", CHARLM, "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["plan", CHARLM, "--set", "parallel.strategy=zero3"]) == 2
    assert "parallel.strategy" in capsys.readouterr().err


_FLOPS_PROBE = """
import json, resource
from torch import nn
from relay.training.efficiency import model_flops_per_sample
from relay.tasks import build_task
task = build_task("digits", "default", {"hidden": [8192] * 8}, None)
batch = task.first_rows(task.load_data(0.1, 0).train, 8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
flops = model_flops_per_sample(task, batch)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import torch
with torch.device("meta"):
    linears = [m for m in task.build_model().modules() if isinstance(m, nn.Linear)]
print(json.dumps({"flops": flops, "growth": after - before,
                  "weights": sum(m.weight.numel() for m in linears),
                  "first": linears[0].weight.numel()}))
"""


@pytest.mark.timeout(120)
def test_model_flops_are_counted_without_building_the_model():
    """The efficiency report counts model FLOPs on rank 0 after training: on a copy made of
    fake tensors, so a rank that holds 1/N of a large model never holds it whole as well."""
    proc = subprocess.run(
        [sys.executable, "-c", _FLOPS_PROBE],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=100, check=True,
    )  # fmt: skip
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    # An MLP's forward + backward: 6 FLOPs per weight per sample (2 forward, 2 for the weight's
    # gradient, 2 for the input's), less the input's gradient at the first layer (the data).
    assert probe["flops"] == 6 * probe["weights"] - 2 * probe["first"]
    # 470 M parameters: 1.9 GB of weights alone, were they real.
    assert probe["weights"] > 450e6
    assert probe["growth"] < 200 * 2**20, probe
