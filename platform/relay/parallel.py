"""Everything distributed, in one place: who am I, where do tensors live, how is the model
wrapped and its optimizer built under each strategy, how gradients are synchronised, and how
numbers and state from all ranks combine.

The loop calls these and never branches on ranks, backends or strategies itself. It imports no
Ray, so relay's Ray Train workers and a plain `torchrun` process (bench/torchrun_ddp.py) run the
very same engine. Whoever launched the process has set up the process group (gloo on CPU, NCCL
on GPU) — Ray Train, with world rank = process-group rank, or torchrun — and names this
process's device once with `set_device`; rank and world come from `torch.distributed`
(0 and 1 when there is no process group), never from environment variables.

Strategies (`parallel.strategy`):
  ddp    full replica per rank; gradients all-reduced (DistributedDataParallel)
  zero1  DDP for gradients + `ZeroRedundancyOptimizer`: each rank keeps 1/N of optimizer state
  fsdp   FSDP2 `fully_shard` per block, then the root: parameters, gradients and optimizer
         state all sharded (ZeRO-3; `reshard_after_forward: false` ≈ ZeRO-2)

Whatever the strategy, `full_state()` yields the same portable state: full (unsharded)
weights, and optimizer state keyed by parameter name — so a checkpoint resumes under another
strategy or worker count, and Serve loads any of them unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relay import checkpoint
from relay.config import ParallelConfig

# --- who am I ------------------------------------------------------------------------------


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def is_main() -> bool:
    return rank() == 0


_device = torch.device("cpu")


def set_device(target: torch.device | str) -> None:
    """Name this process's device (the launcher knows it: Ray Train's `get_device()`, or
    cuda:LOCAL_RANK under torchrun); until then it is the CPU."""
    global _device
    _device = torch.device(target)
    if _device.type == "cuda":
        torch.cuda.set_device(_device)  # the current device for NCCL and for new tensors


def device() -> torch.device:
    return _device


def _distributed() -> bool:
    return _initialized() and dist.get_world_size() > 1


def set_threads(threads: int | None, reserved_cpus: float) -> None:
    """One intra-op thread per reserved CPU unless told otherwise: torch's default (all cores)
    oversubscribes a machine that several workers share."""
    torch.set_num_threads(threads or max(1, int(reserved_cpus)))


def barrier() -> None:
    if _distributed():
        dist.barrier()


def synchronize() -> None:
    """Wait for queued device work, so a host clock measures what the device did."""
    if torch.cuda.is_available() and device().type == "cuda":
        torch.cuda.synchronize(device())


# `parallel.mixed_precision` → the compute dtype (None: fp32, no autocast).
PRECISION_DTYPES: dict[str, torch.dtype | None] = {
    "none": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


# --- model surgery: units, activation checkpointing, compile ---------------------------------


def units(model: nn.Module) -> list[nn.Module]:
    """The repeated building blocks FSDP shards by and activation checkpointing recomputes:
    the items of the model's `nn.ModuleList`s (transformer blocks), else its parameterised
    leaf layers (an MLP's linears)."""
    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    if blocks:
        return blocks
    return [
        m
        for m in model.modules()
        if m is not model and not list(m.children()) and any(True for _ in m.parameters())
    ]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each unit's activations in backward instead of storing them.

    The unit's `forward` is replaced in place rather than wrapped in another module, so
    parameter names — and thus checkpoints — do not change; module hooks (FSDP's) stay outside.
    """
    from torch.utils.checkpoint import checkpoint

    for unit in units(model):
        inner = unit.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = forward


def compile_model(model: nn.Module) -> None:
    """torch.compile each block's forward (or the whole forward when there are no blocks).

    Compiling `forward` in place keeps parameter names and keeps DDP/FSDP hooks out of the
    compiled graph."""
    has_blocks = any(isinstance(m, nn.ModuleList) for m in model.modules())
    for target in units(model) if has_blocks else [model]:
        target.forward = torch.compile(target.forward)


# --- the strategy engine -----------------------------------------------------------------------


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
        self._tied = checkpoint.tied_aliases(model)
        self._names = [name for name, _ in model.named_parameters()]
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        if cfg.compile:
            compile_model(model)
        self._dtype = PRECISION_DTYPES[cfg.mixed_precision]
        if cfg.strategy == "fsdp":
            self.model = self._shard(model)
        else:
            self.model = self._replicate(model)
        params = list(self.model.parameters())
        self._zero = cfg.strategy == "zero1" and _distributed()
        if self._zero:
            # Imported only here: torch.distributed.optim takes ~1.7 s to import on this
            # machine (TorchScript), which every other strategy, and every driver importing
            # this module, would pay.
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(
                params, optimizer_class=optimizer_class, **optimizer_kwargs
            )
        else:
            self.optimizer = optimizer_class(params, **optimizer_kwargs)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        # (config.py refuses fp16 with fsdp: the scaler would not agree across shards.)
        self._scaler = (
            torch.amp.GradScaler(self.device.type) if cfg.mixed_precision == "fp16" else None
        )

    def _replicate(self, model: nn.Module) -> nn.Module:
        """ddp and zero1: the model on this device, in DistributedDataParallel when there is
        more than one rank.

        This is what `ray.train.torch.prepare_model(model, parallel_strategy_kwargs=...)` did
        (Ray 2.60, ray/train/v2/torch/train_loop_utils.py), written out so that no Ray is
        needed and a torchrun process builds the identical wrapper: move to the device (which
        `set_device` made current on GPU); wrap only at world size > 1 (one process trains the
        bare module, no DDP hooks); on GPU pin DDP to this rank's device (`device_ids`,
        `output_device`). Nothing else of prepare_model applies (its FSDP1 branch: fsdp is
        FSDP2, in `_shard`)."""
        model = model.to(self.device)
        if not _distributed():
            return model
        # Gradients as views into DDP's communication buckets: no copy in or out of them.
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True}
        if self.device.type == "cuda":
            kwargs.update(device_ids=[self.device], output_device=self.device)
        # DDP broadcasts rank 0's parameters on construction: every replica starts equal.
        return DistributedDataParallel(model, **kwargs)

    def _shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model.to(self.device)
        if not _distributed():
            return model
        policy = MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32)
        for unit in units(model):
            fully_shard(
                unit, reshard_after_forward=self.cfg.reshard_after_forward, mp_policy=policy
            )
        # The root holds what no unit does (embeddings, tied head, final norm); it is gathered
        # for the whole step anyway, so it is not resharded after forward.
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        return model

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
        if self.cfg.strategy == "fsdp" and _distributed():
            return None
        return state_digest(self.plain.state_dict())

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A snapshot of (full weights, optimizer state keyed by parameter name) on rank 0 —
        empty dicts on the others. A collective: every rank must call it. The tensors are
        copies: training on does not change a snapshot already taken."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sharded = self.cfg.strategy == "fsdp" and _distributed()
        if sharded:
            weights = get_model_state_dict(self.model, options=options)
        else:
            weights = self.plain.state_dict() if is_main() else {}
        weights = {k: v for k, v in weights.items() if k not in self._tied}
        if self._is_zero():
            self.optimizer.consolidate_state_dict(to=0)
            optim = self._by_name(self.optimizer.state_dict()) if is_main() else {}
        elif sharded:
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        else:
            optim = self._by_name(self.optimizer.state_dict()) if is_main() else {}
        return _snapshot(weights), _snapshot(optim)

    def load_optimizer_state(self, named: dict[str, Any]) -> None:
        """Load optimizer state saved by `full_state` under any strategy and worker count.

        The optimizer gets copies: torch's `load_state_dict` would otherwise keep the caller's
        tensors and update them in place as training goes on."""
        named = _snapshot(named)
        if self.cfg.strategy == "fsdp" and _distributed():
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                named,
                options=StateDictOptions(full_state_dict=True),
            )
            return
        self.optimizer.load_state_dict(checkpoint.optimizer_state_by_index(named, self._names))

    def _by_name(self, state: dict[str, Any]) -> dict[str, Any]:
        return checkpoint.optimizer_state_by_name(state, self._names)

    def _is_zero(self) -> bool:
        return self._zero

    # --- what it costs ---

    def time_micro_steps(self, loss_fn: Callable[[], torch.Tensor], steps: int = 3) -> dict:
        """Seconds per forward/backward with and without gradient synchronisation, measured
        on this rank with all ranks in lock-step. Their difference is what the gradient
        communication costs a step; the optimizer is not stepped (gradients are discarded)."""
        timings = {}
        for sync in (False, True, False, True):  # each twice: the first pass warms up
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


def _snapshot(tree: Any) -> Any:
    """A CPU copy of every tensor in a nested dict/list (`.cpu()` of a CPU tensor aliases)."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: _snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_snapshot(value) for value in tree)
    return tree


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside whatever wrapper parallel.py put around it (FSDP2 shards in
    place, so an FSDP model is its own plain module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


# --- measuring the hardware --------------------------------------------------------------------


def current_memory() -> int:
    """Memory this rank holds now: allocated on GPU, the process's resident set on CPU."""
    if device().type == "cuda":
        return torch.cuda.memory_allocated(device())
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_memory() -> dict[str, Any]:
    """Peak memory of this rank: the allocator's peak on GPU, the process's peak RSS on CPU."""
    if device().type == "cuda":
        return {"bytes": torch.cuda.max_memory_allocated(device()), "kind": "cuda_allocated"}
    # ru_maxrss is in KiB on Linux.
    return {
        "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kind": "process_peak_rss",
    }


# --- combining numbers from all ranks ----------------------------------------------------------


def sum_across_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each named scalar over all ranks (one collective for the whole dict)."""
    names = sorted(values)
    packed = torch.stack([values[n].detach().double().cpu() for n in names])
    if _distributed():
        packed = packed.to(device())
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.cpu().tolist(), strict=True))


def gather_objects(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order (a collective: all ranks must call it)."""
    if not _distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def state_digest(weights: dict[str, torch.Tensor]) -> str:
    """A hash of a state dict: equal on every rank iff replicas agree."""
    h = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
