"""Two ranks on one GPU, run by tests/test_gpu.py under torchrun: fsdp's GPU paths with more
than one rank.

torchrun --nproc_per_node 2 tests/gpu_ranks.py OUT.json SHARDS_DIR

NCCL refuses two ranks on one device, and a lent machine has one GPU, so gloo carries the
collectives here; everything else is the GPU's: the sharded parameters, gradients and
optimizer state, fsdp's meta-device build materialised on the GPU, the bf16 casts, and the
sharded checkpoint written from and read back into GPU tensors. Each rank trains on its own
rows of the same data, with the same seed, under every variant; rank 0 writes the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from relay import parallel
from relay.config import OptimConfig, ParallelConfig
from relay.tasks import build_task
from relay.training import footprint
from relay.training.epochs import optimizer_spec

ROWS_PER_RANK_STEP = 16
STEPS = 4


def main() -> None:
    out, shards = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    parallel.set_device("cuda:0")
    rank, world = parallel.rank(), parallel.world_size()
    task = build_task("charlm", "debug", {"n_layer": 2, "dropout": 0.0})
    tokens = torch.as_tensor(task.load_data(0.2, 0).train["tokens"]).long()
    spec = optimizer_spec(OptimConfig(lr=0.003, weight_decay=0.1))

    def rows(step: int) -> torch.Tensor:
        start = (step * world + rank) * ROWS_PER_RANK_STEP
        return tokens[start : start + ROWS_PER_RANK_STEP].to(parallel.device())

    def train(engine: parallel.Engine, steps: range) -> list[float]:
        losses = []
        for step in steps:
            engine.zero_grad()
            with engine.micro_step():
                loss, _ = task.loss_and_stats(engine.model, {"tokens": rows(step)})
                engine.backward(loss)
            engine.step(grad_clip=1.0)
            losses.append(parallel.sum_across_ranks({"loss": loss.detach()})["loss"] / world)
        return losses

    def build(cfg: ParallelConfig, seed: int = 0) -> parallel.Engine:
        torch.manual_seed(seed)
        return parallel.Engine(task.build_model(), cfg, *spec)

    fsdp = ParallelConfig(strategy="fsdp")
    results: dict = {"losses": {}, "state_bytes": {}, "devices": {}}
    for name, cfg in {
        "ddp": ParallelConfig(strategy="ddp"),
        "fsdp": fsdp,
        "fsdp_bf16": ParallelConfig(strategy="fsdp", mixed_precision="bf16"),
    }.items():
        engine = build(cfg)
        results["losses"][name] = train(engine, range(STEPS))
        results["state_bytes"][name] = footprint.state_bytes(engine.model, engine.optimizer)
        results["devices"][name] = sorted(
            {footprint.local(p).device.type for p in engine.model.parameters()}
        )
        if name == "fsdp":
            engine.save_sharded(shards)  # each rank writes its own GPU shards
            results["shard_files"] = sorted(p.name for p in shards.iterdir())
            results["losses"]["continued_fsdp"] = train(engine, range(STEPS, STEPS + 2))

    # fsdp built on the meta device: each rank materialises only its shards, on the GPU. Each
    # rank checks its own shards against the same slice of the whole model built on the CPU
    # (gathering them whole through gloo-on-GPU segfaults in torch 2.11's functional
    # collectives: a limit of this test's transport, which NCCL does not share).
    torch.manual_seed(0)
    with torch.device("meta"):
        on_meta = task.build_model()
    engine = parallel.Engine(on_meta, fsdp, *spec)
    torch.manual_seed(0)
    whole = dict(task.build_model().named_parameters())  # the reference, built on the CPU

    def slice_of_whole(name: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the reference parameter, cut as fsdp cut `param`."""
        reference = whole[name].detach().to(parallel.device())
        placed = distribute_tensor(
            reference, param.device_mesh, param.placements, src_data_rank=None
        )
        return placed.to_local().cpu()

    mine = [
        torch.equal(footprint.local(param).cpu(), slice_of_whole(name, param))
        for name, param in engine.model.named_parameters()
    ]
    results["meta_shards_equal"] = all(all(r) for r in parallel.gather_objects(mine))
    results["meta_parameters"] = len(mine)
    results["losses"]["fsdp_meta"] = train(engine, range(STEPS))

    # The shards fsdp wrote, resumed under ddp (whole replicas) and fsdp: DCP reshards.
    for name in ("ddp", "fsdp"):
        engine = build(ParallelConfig(strategy=name), seed=1)
        engine.load_sharded(shards)
        results["losses"][f"resumed_{name}"] = train(engine, range(STEPS, STEPS + 2))

    if rank == 0:
        out.write_text(json.dumps(results, indent=2))
    parallel.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
