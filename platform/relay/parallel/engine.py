"""The Engine: the model as the training loop sees it, the same for every strategy — wrapped
(by the configured strategy), with its optimizer, precision, gradient-sync switch and portable
state."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relay.checkpoints import checkpoint
from relay.config import ParallelConfig
from relay.parallel.blocks import apply_activation_checkpointing, compile_model
from relay.parallel.ddp import DDP, unwrap
from relay.parallel.fsdp import FSDP, on_meta
from relay.parallel.ranks import barrier, device, distributed, synchronize
from relay.parallel.state import snapshot, state_digest
from relay.parallel.strategy import Strategy
from relay.parallel.zero1 import Zero1

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "zero1": Zero1, "fsdp": FSDP}

# `parallel.mixed_precision` → the compute dtype (None: fp32, no autocast).
PRECISION_DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def strategy_for(name: str) -> Strategy:
    """The configured strategy; on one rank there is nothing to shard or synchronise, and
    every strategy trains the bare module as ddp does."""
    return STRATEGIES[name]() if distributed() else DDP()


class Engine:
    """The model as the loop sees it: wrapped for the configured strategy, with its optimizer,
    precision, gradient-sync switch and portable state.

    engine = parallel.Engine(plain_model, cfg.parallel, optimizer_class, optimizer_kwargs)
    engine.zero_grad()
    for i, batch in enumerate(micro_batches):
        with engine.micro_step(sync=i == len(micro_batches) - 1):
            loss = ...(engine.model, batch)
            engine.backward(loss / len(micro_batches))
    engine.step(grad_clip)
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ParallelConfig,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        self.cfg = cfg
        self.device = device()
        self.strategy = strategy_for(cfg.strategy)
        self._tied = checkpoint.tied_aliases(model)
        self._names = [name for name, _ in model.named_parameters()]
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        if cfg.compile:
            compile_model(model)
        self._dtype = PRECISION_DTYPES[cfg.mixed_precision]
        built_on_meta = on_meta(model)  # fsdp's meta init (worker_loop.py decides)
        self.model = self.strategy.wrap(model, self.device, cfg, self._dtype)
        if built_on_meta:
            self.strategy.materialise(self.model, self.device)
        self.optimizer = self.strategy.optimizer(
            list(self.model.parameters()), optimizer_class, optimizer_kwargs
        )
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        # (config.py refuses fp16 with fsdp: the scaler would not agree across shards.)
        self._scaler = (
            torch.amp.GradScaler(self.device.type) if cfg.mixed_precision == "fp16" else None
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in (fp32 without mixed precision)."""
        return self._dtype or torch.float32

    @property
    def plain(self) -> nn.Module:
        """The module inside whatever wrapper the strategy put around it."""
        return unwrap(self.model)

    # --- a step ---

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def micro_step(self, sync: bool = True) -> Iterator[None]:
        """Forward/backward of one micro-batch in the configured precision; with `sync` false
        the gradients only accumulate locally (no all-reduce / reduce-scatter)."""
        with self._gradient_sync(sync), self.autocast():
            yield

    def autocast(self):
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    def _gradient_sync(self, enabled: bool):
        if isinstance(self.model, DistributedDataParallel) and not enabled:
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler else loss).backward()

    def step(self, grad_clip: float | None = None) -> None:
        if self._scaler:
            self._scaler.unscale_(self.optimizer)
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if self._scaler:
            self._scaler.step(self.optimizer)
            self._scaler.update()
        else:
            self.optimizer.step()

    # --- portable state ---

    def scaler_state(self) -> dict[str, Any] | None:
        return self._scaler.state_dict() if self._scaler else None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self._scaler and state:
            self._scaler.load_state_dict(state)

    def replica_digest(self) -> str | None:
        """A hash of this rank's full replica (ddp, zero1); None where ranks hold shards."""
        if not self.strategy.holds_full_replica:
            return None
        return state_digest(self.plain.state_dict())

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A snapshot of (full weights, optimizer state keyed by parameter name) on rank 0 —
        empty dicts on the others. A collective: every rank must call it. The tensors are
        copies: training on does not change a snapshot already taken."""
        weights, optim = self.strategy.full_state(self.model, self.optimizer, self._names)
        weights = {k: v for k, v in weights.items() if k not in self._tied}
        return snapshot(weights), snapshot(optim)

    def save_sharded(self, path: Path) -> None:
        """Every rank writes its own shards of weights and optimizer state under `path`
        (torch.distributed.checkpoint: one file per rank, plus `.metadata` from rank 0), in
        parallel and without gathering anything whole. A collective."""
        from relay.checkpoints import sharded  # DCP: imported when a run checkpoints this way

        sharded.save(self.strategy.sharded_state(self.model, self.optimizer, self._tied), path)

    def load_sharded(self, path: Path) -> None:
        """Weights and optimizer state from `save_sharded`'s files, whatever worker count and
        strategy wrote them (DCP reshards). A collective."""
        self.strategy.load_sharded(self.model, self.optimizer, path, self._tied, self._names)

    def load_optimizer_state(self, named: dict[str, Any]) -> None:
        """Load optimizer state saved by `full_state` under any strategy and worker count.

        The optimizer gets copies: torch's `load_state_dict` would otherwise keep the caller's
        tensors and update them in place as training goes on."""
        self.strategy.load_optimizer_state(self.model, self.optimizer, snapshot(named), self._names)

    # --- what it costs ---

    def time_micro_steps(
        self, loss_fn: Callable[[], torch.Tensor], steps: int = 3, sync_only: bool = False
    ) -> dict:
        """Seconds per forward/backward with and without gradient synchronisation, measured
        on this rank with all ranks in lock-step. Their difference is what the gradient
        communication costs a step; the optimizer is not stepped (gradients are discarded).
        `sync_only`: the synchronised pass alone (`local_step_s` None)."""
        timings = {"local": None}
        passes = (True, True) if sync_only else (False, True, False, True)
        for sync in passes:  # each twice: the first pass warms up
            self.zero_grad()
            barrier()
            started = time.perf_counter()
            for _ in range(steps):
                with self.micro_step(sync=sync):
                    self.backward(loss_fn())
            synchronize()
            barrier()  # a rank's clock stops when the slowest rank is done
            timings["sync" if sync else "local"] = (time.perf_counter() - started) / steps
        self._gradient_sync(True)
        self.zero_grad()
        return {"local_step_s": timings["local"], "synced_step_s": timings["sync"]}
