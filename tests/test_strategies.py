"""The strategies against each other, on a real 2-worker gloo process group through Ray Train.

One worker group drives `parallel.Engine` directly under every strategy with the same seed and
data, so the comparisons are exact-data, step for step: zero1 and fsdp must reproduce ddp in
fp32, gradient accumulation over 2 micro-batches of b must reproduce 1 batch of 2b, activation
checkpointing must change nothing, and state saved under one strategy must resume under another.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import ray.cloudpickle

pytestmark = pytest.mark.timeout(300)

# Ray workers cannot import this test module by name: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS_PER_RANK_STEP = 16
STEPS = 4


def _engine_runs(_config: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from relay import parallel
    from relay.config import OptimConfig, ParallelConfig
    from relay.tasks import build_task
    from relay.training import footprint
    from relay.training.epochs import optimizer_spec

    torch.set_num_threads(1)
    task = build_task("charlm", "debug", {"n_layer": 2, "dropout": 0.0})
    tokens = torch.as_tensor(task.load_data(0.2, 0).train["tokens"]).long()
    rank, world = parallel.rank(), parallel.world_size()
    shards = Path(_config["shards"])  # on this one machine, every rank sees it
    spec = optimizer_spec(OptimConfig(lr=0.003, weight_decay=0.1))

    def rows(step: int) -> torch.Tensor:
        start = (step * world + rank) * ROWS_PER_RANK_STEP
        return tokens[start : start + ROWS_PER_RANK_STEP]

    def build(parallel_cfg: ParallelConfig, state=None) -> parallel.Engine:
        torch.manual_seed(0)
        model = task.build_model()
        if state is not None:
            # Strict: every key of the model must come from the saved state. The tied head is
            # saved once, as tok_emb.weight (checkpoint.tied_aliases), so it is given here.
            weights = {**state["weights"], "head.weight": state["weights"]["tok_emb.weight"]}
            model.load_state_dict(weights, strict=True)
        engine = parallel.Engine(model, parallel_cfg, *spec)
        if state is not None:
            engine.load_optimizer_state(state["optimizer"])
        return engine

    def train(engine: parallel.Engine, steps: range) -> list[float]:
        accum = engine.cfg.grad_accum
        losses = []
        for step in steps:
            engine.zero_grad()
            total = torch.zeros(())
            for i, micro in enumerate(rows(step).chunk(accum)):
                with engine.micro_step(sync=i == accum - 1):
                    loss, _ = task.loss_and_stats(engine.model, {"tokens": micro})
                    engine.backward(loss / accum)
                total += loss.detach() / accum
            engine.step(grad_clip=1.0)
            losses.append(parallel.sum_across_ranks({"loss": total})["loss"] / world)
        return losses

    def full_state(engine: parallel.Engine) -> dict:
        weights, optimizer = engine.full_state()
        shared = [{"weights": weights, "optimizer": optimizer}]
        dist.broadcast_object_list(shared, src=0)  # every rank resumes from rank 0's copy
        return shared[0]

    variants = {
        "ddp": ParallelConfig(strategy="ddp"),
        "zero1": ParallelConfig(strategy="zero1"),
        "fsdp": ParallelConfig(strategy="fsdp"),
        "fsdp_no_reshard": ParallelConfig(strategy="fsdp", reshard_after_forward=False),
        "fsdp_checkpointed": ParallelConfig(strategy="fsdp", activation_checkpointing=True),
        "ddp_accum2": ParallelConfig(strategy="ddp", grad_accum=2),
        "zero1_accum2": ParallelConfig(strategy="zero1", grad_accum=2),
        "fsdp_accum2": ParallelConfig(strategy="fsdp", grad_accum=2),
    }
    out: dict = {"losses": {}, "weights": {}, "state_bytes": {}}
    saved = None
    for name, parallel_cfg in variants.items():
        engine = build(parallel_cfg)
        out["losses"][name] = train(engine, range(STEPS))
        out["state_bytes"][name] = footprint.state_bytes(engine.model, engine.optimizer)
        state = full_state(engine)
        out["weights"][name] = {k: v.numpy() for k, v in state["weights"].items()}
        if name == "fsdp":
            saved = state
            engine.save_sharded(shards)  # every rank writes its own shards, nothing gathered
            out["shard_files"] = sorted(p.name for p in shards.iterdir())
            out["losses"]["continued_fsdp"] = train(engine, range(STEPS, STEPS + 2))
    # fsdp with the model built on the meta device: each rank materialises its own shards.
    torch.manual_seed(0)
    with torch.device("meta"):
        on_meta = task.build_model()
    engine = parallel.Engine(on_meta, variants["fsdp"], *spec)
    # The weights alone (engine.full_state would also make torch initialise Adam's state, with
    # a step of its own that changes the steps after it).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    initial = get_model_state_dict(engine.model, options=options)
    out["meta_initial_weights"] = {k: v.numpy() for k, v in initial.items()}
    out["losses"]["fsdp_meta"] = train(engine, range(STEPS))
    # Resume fsdp's state under each strategy for two more steps: from the full state gathered
    # on rank 0, and from the shards (into a model initialised otherwise, so nothing is left
    # from before the load).
    for name in ("ddp", "zero1", "fsdp"):
        engine = build(variants[name], saved)
        out["losses"][f"resumed_{name}"] = train(engine, range(STEPS, STEPS + 2))
        torch.manual_seed(1)
        engine = parallel.Engine(task.build_model(), variants[name], *spec)
        engine.load_sharded(shards)
        out["losses"][f"resumed_{name}_from_shards"] = train(engine, range(STEPS, STEPS + 2))
    out["optimizer_params"] = sorted(saved["optimizer"]["state"])
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    import ray.train
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        _engine_runs,
        train_loop_config={"shards": str(tmp_path_factory.mktemp("engine-shards") / "fsdp")},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name="engine-runs", storage_path=str(tmp_path_factory.mktemp("engine-runs"))
        ),
    )
    return trainer.fit().return_value


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["zero1", "fsdp", "fsdp_no_reshard", "fsdp_checkpointed"])
def test_strategy_matches_ddp_in_fp32(runs, name):
    losses = runs["losses"]
    assert losses["ddp"][-1] < losses["ddp"][0]  # it trains at all
    assert _close(losses[name], losses["ddp"]), (name, losses[name], losses["ddp"])
    for key, ddp_value in runs["weights"]["ddp"].items():
        np.testing.assert_allclose(runs["weights"][name][key], ddp_value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_two_micro_batches_of_b_match_one_batch_of_2b(runs, strategy):
    assert _close(runs["losses"][f"{strategy}_accum2"], runs["losses"][strategy])


def test_full_state_is_the_same_whatever_the_strategy(runs):
    weights = runs["weights"]
    assert set(weights["fsdp"]) == set(weights["ddp"]) == set(weights["zero1"])
    assert "head.weight" not in weights["fsdp"]  # tied to tok_emb.weight: stored once
    assert "tok_emb.weight" in runs["optimizer_params"]  # optimizer state keyed by name


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_state_saved_under_fsdp_resumes_under_any_strategy(runs, strategy):
    # Resuming from the saved state must continue exactly as the run that was never stopped.
    resumed = runs["losses"][f"resumed_{strategy}"]
    assert _close(resumed, runs["losses"]["continued_fsdp"]), runs["losses"]
    assert resumed[0] < runs["losses"]["fsdp"][0]  # it continued, not restarted


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_shards_written_by_each_fsdp_rank_resume_under_any_strategy(runs, strategy):
    # One file per rank, each written by its rank, and the index; nothing gathered.
    assert runs["shard_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = runs["losses"][f"resumed_{strategy}_from_shards"]
    assert _close(resumed, runs["losses"]["continued_fsdp"]), runs["losses"]


def test_fsdp_built_on_meta_starts_and_trains_as_a_whole_build(runs):
    import torch

    from relay.tasks import build_task

    # The reference: the whole model built in this process under the same seed.
    torch.manual_seed(0)
    whole = build_task("charlm", "debug", {"n_layer": 2, "dropout": 0.0}).build_model()
    expected = {k: v.numpy() for k, v in whole.state_dict().items()}
    got = runs["meta_initial_weights"]
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert runs["losses"]["fsdp_meta"] == runs["losses"]["fsdp"]


def test_sharded_strategies_hold_less_per_rank(runs):
    ddp, zero1, fsdp = (runs["state_bytes"][s] for s in ("ddp", "zero1", "fsdp"))
    assert zero1["param_bytes"] == ddp["param_bytes"]
    assert zero1["optimizer_bytes"] < 0.7 * ddp["optimizer_bytes"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert fsdp[key] == pytest.approx(ddp[key] / 2, rel=0.05), key
