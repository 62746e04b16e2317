"""Everything distributed, in one place: who am I, where do tensors live, how is the model
wrapped and its optimizer built under each strategy, how gradients are synchronised, and how
numbers and state from all ranks combine.

The loop calls these and never branches on ranks, backends or strategies itself. Nothing here
imports Ray, so relay's Ray Train workers and a plain `torchrun` process
(bench/torchrun_ddp.py) run the very same engine.

  ranks.py     who am I (rank, world, device, threads), barriers, collectives over numbers
  blocks.py    the sharding plan: each model family's repeated blocks, named explicitly — the
               unit of sharding, activation checkpointing, compile
  strategy.py  what a strategy decides (wrap, optimizer, full state out, optimizer state in)
  ddp.py       ddp   full replica per rank; gradients all-reduced (DistributedDataParallel)
  zero1.py     zero1 DDP for gradients + `ZeroRedundancyOptimizer`: each rank keeps 1/N of
                     optimizer state
  fsdp.py      fsdp  FSDP2 `fully_shard` per block, then the root: parameters, gradients and
                     optimizer state all sharded (ZeRO-3; `reshard_after_forward: false` ≈
                     ZeRO-2)
  engine.py    the Engine: the configured strategy, precision, micro-steps, portable state
  state.py     snapshots and digests of state
  hardware.py  memory this rank holds

Whatever the strategy, `Engine.full_state()` yields the same portable state: full (unsharded)
weights, and optimizer state keyed by parameter name — so a checkpoint resumes under another
strategy or worker count, and Serve loads any of them unchanged.
"""

from relay.parallel.blocks import (
    apply_activation_checkpointing,
    compile_model,
    register_blocks,
    units,
)
from relay.parallel.ddp import unwrap
from relay.parallel.engine import PRECISION_DTYPES, STRATEGIES, Engine
from relay.parallel.hardware import current_memory, peak_memory, peak_since_reset, reset_peak
from relay.parallel.ranks import (
    barrier,
    cpu_setup,
    device,
    distributed,
    gather_objects,
    is_main,
    rank,
    set_device,
    set_threads,
    sum_across_ranks,
    synchronize,
    world_size,
)
from relay.parallel.state import state_digest

__all__ = [
    "PRECISION_DTYPES",
    "STRATEGIES",
    "Engine",
    "apply_activation_checkpointing",
    "barrier",
    "compile_model",
    "cpu_setup",
    "current_memory",
    "device",
    "distributed",
    "gather_objects",
    "is_main",
    "peak_memory",
    "peak_since_reset",
    "rank",
    "register_blocks",
    "reset_peak",
    "set_device",
    "set_threads",
    "state_digest",
    "sum_across_ranks",
    "synchronize",
    "units",
    "unwrap",
    "world_size",
]
