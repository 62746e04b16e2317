"""`relay plan`: memory per rank, measured from the real model (in-process, CPU, no Ray)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess

import pytest
from support import BIN, REPO, subprocess_env

from relay import config
from relay.cli import main
from relay.plan import parse_bytes
from relay.tasks import build_task

CHARLM = "jobs/configs/charlm.yaml"
DIGITS = "jobs/configs/digits.yaml"


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


@pytest.mark.timeout(120)
def test_sharding_divides_state_by_workers():
    workers = 4
    report = plan_json(CHARLM, "--workers", str(workers), "--set", "model.n_layer=3")
    ddp, zero1, fsdp = (report["strategies"][s] for s in ("ddp", "zero1", "fsdp"))
    model = report["model"]
    assert ddp["model_state_bytes"] == 2 * model["param_bytes"] + model["optimizer_bytes"]
    # zero1 shards the optimizer state only.
    assert abs(zero1["optimizer_bytes"] - ddp["optimizer_bytes"] / workers) <= 1
    assert zero1["param_bytes"] == ddp["param_bytes"]
    assert zero1["grad_bytes"] == ddp["grad_bytes"]
    # fsdp shards all of it, and gathers the root plus one block (of three) at a time.
    gathered = fsdp["gathered_param_bytes"]
    assert 0 < gathered < model["param_bytes"]
    sharded = fsdp["model_state_bytes"] - gathered
    assert math.isclose(sharded, ddp["model_state_bytes"] / workers, abs_tol=3)
    for entry in (ddp, zero1, fsdp):
        assert entry["total_bytes"] == entry["model_state_bytes"] + entry["activation_bytes"]
        assert entry["activation_bytes"] == ddp["activation_bytes"]

    # Without resharding after forward every parameter stays gathered until backward.
    kept = plan_json(CHARLM, "--workers", str(workers), "--set", "model.n_layer=3",
                     "--set", "parallel.reshard_after_forward=false")  # fmt: skip
    assert kept["strategies"]["fsdp"]["gathered_param_bytes"] == model["param_bytes"]

    # One worker: nothing to shard over, fsdp holds what ddp does.
    single = plan_json(CHARLM, "--workers", "1")["strategies"]
    assert single["fsdp"]["total_bytes"] == single["ddp"]["total_bytes"]


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
    assert bf16["ddp"]["activation_bytes"] < fp32["ddp"]["activation_bytes"]
    # fp32 master weights, gradients and optimizer state either way.
    assert bf16["ddp"]["model_state_bytes"] == fp32["ddp"]["model_state_bytes"]
    # FSDP gathers parameters in the compute dtype: half of fp32's.
    assert bf16["fsdp"]["gathered_param_bytes"] * 2 == fp32["fsdp"]["gathered_param_bytes"]
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
