"""`relay plan`: the memory wall, measured — what one rank holds under ddp, zero1 and fsdp.

Everything is measured in-process on CPU from the configured model, optimizer and real training
samples (no Ray, no GPU), then extrapolated to the configured batch size and worker count:

  parameters   the real parameters' bytes (fp32; tied weights counted once)
  gradients    one fp32 gradient per parameter: the same bytes as the parameters
  optimizer    the real optimizer (`loop.build_optimizer`) after one real backward and step: the
               bytes of every tensor in `optimizer.state`
  activations  the tensors autograd saves for backward in one forward (and loss) of real
               samples, under autocast for bf16/fp16 and with activation checkpointing if
               configured; counted once per storage, parameters excluded. Measured at two small
               batches to fit `fixed + per_sample × batch`, then taken at `batch_size` (one
               micro-batch: `grad_accum` does not change it)

Per rank, with N workers (P, G, O: full parameter, gradient and optimizer bytes; A: activations):

  ddp    P + G + O + A          every rank a full replica
  zero1  P + G + O/N + A        optimizer state sharded (ZeroRedundancyOptimizer)
  fsdp   (P + G + O)/N + W + A  everything sharded; W is what is gathered at once in the compute
                                dtype: the root's own parameters (embeddings, tied head, final
                                norm: parallel/fsdp.py keeps them gathered for the step) plus the
                                largest unit's — or every parameter with
                                `reshard_after_forward: false`. With N = 1, fsdp does not shard
                                (parallel/engine.py), so it costs what ddp does.

"/N" is what the fullest rank really gets, as torch splits, not an even split (tests/test_plan.py
checks the figures against the bytes a real `parallel.Engine` holds):
  zero1  whole parameters go to ranks, largest first, each to the rank with the fewest elements
         so far (ZeroRedundancyOptimizer's partition); the fullest rank's optimizer state counts.
  fsdp   each parameter is split along its first dimension, padded to a multiple of N rows:
         parameters and gradients hold ceil(rows / N) rows per rank, padding included; the
         optimizer's parameter-shaped state (AdamW's moments) the real rows of rank 0, the
         fullest; its per-parameter scalars (AdamW's `step`) are not sharded: every rank has all.

Mixed precision keeps fp32 master weights, gradients and optimizer state; it shrinks the saved
activations and fsdp's gathered parameters.

Assumptions — read the numbers as an estimate of what the training step itself holds:
  * not counted: the CUDA context and allocator fragmentation, communication buckets,
    temporaries of backward (activation gradients), a second unit that FSDP prefetches,
    and the data pipeline;
  * with activation checkpointing, the largest unit's activations are added once: backward
    recomputes one unit at a time;
  * autocast's low-precision copies of the weights are saved for backward too; they appear in
    the batch-independent (fixed) part of the activations;
  * `compile` is ignored: the model is measured eagerly (compiled graphs may save less);
  * kernels are CPU's: where CUDA picks another kernel, it may save other tensors. Notably
    attention with dropout takes SDPA's math path on CPU, which saves the T×T attention
    probabilities of every head; CUDA's flash and memory-efficient kernels do not, so for
    attention models with dropout the activations here are an upper bound.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from relay.config import ConfigError, RunConfig
from relay.observe.console import human_bytes
from relay.parallel import PRECISION_DTYPES, apply_activation_checkpointing, units
from relay.tasks import Task, build_task
from relay.training.epochs import build_optimizer

STRATEGIES = ("ddp", "zero1", "fsdp")
PROBE_BATCHES = (2, 4)  # two small batches fit the line; batch 1 can take special code paths

# --- sizes in and out ----------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '512MiB', '1e9' → bytes; ValueError when it is none of those."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 80GiB, 80GB, 512MiB, 1e9)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{text!r} must be at least 1 byte")
    return int(value)


def default_device_memory() -> tuple[int, str]:
    """The GPU's total memory where there is one, else this machine's physical RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"GPU 0 ({props.name})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


# --- measuring -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamState:
    """One parameter as the strategies split it: by rows (its first dimension)."""

    numel: int
    rows: int
    itemsize: int
    optimizer_bytes_per_element: int  # its parameter-shaped optimizer state (moments)
    optimizer_fixed_bytes: int  # the rest of its optimizer state (e.g. AdamW's `step`)

    @property
    def optimizer_bytes(self) -> int:
        return self.numel * self.optimizer_bytes_per_element + self.optimizer_fixed_bytes


@dataclass(frozen=True)
class ModelState:
    """Full (unsharded) sizes of one replica."""

    parameters: int
    param_bytes: int
    optimizer_bytes: int
    unit_parameters: int  # the largest unit's: what FSDP gathers at once
    root_parameters: int  # in no unit: FSDP's root keeps them gathered for the whole step
    tensors: tuple[ParamState, ...] = ()  # per parameter, in the model's order

    def zero1_optimizer_bytes(self, workers: int) -> int:
        """The fullest rank's optimizer state under ZeroRedundancyOptimizer's partition:
        parameters largest first (a stable sort), each to the rank with the fewest elements."""
        elements, state = [0] * workers, [0] * workers
        for param in sorted(self.tensors, key=lambda t: t.numel, reverse=True):
            rank = elements.index(min(elements))
            elements[rank] += param.numel
            state[rank] += param.optimizer_bytes
        return max(state)

    def fsdp_rank0_bytes(self, workers: int) -> tuple[int, int]:
        """(parameter bytes, optimizer bytes) of rank 0, the fullest, under FSDP2's padded
        row split; gradients take the parameters' padded bytes."""
        params = optimizer = 0
        for t in self.tensors:
            rows = math.ceil(t.rows / workers)
            row_numel = t.numel // max(t.rows, 1)
            params += rows * row_numel * t.itemsize
            optimizer += rows * row_numel * t.optimizer_bytes_per_element + t.optimizer_fixed_bytes
        return params, optimizer


@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes of one micro-batch: `fixed + per_sample × batch`."""

    fixed: float
    per_sample: float

    def at(self, batch: int) -> int:
        return max(0, round(self.fixed + self.per_sample * batch))


def measure_model_state(cfg: RunConfig, task: Task, batch: dict[str, torch.Tensor]) -> ModelState:
    model = task.build_model().train()
    params = list(model.parameters())  # deduplicated: a tied weight is one parameter
    optimizer = build_optimizer(cfg.optim, params)
    # Optimizers create their state lazily, on the first step: take one, for real.
    loss, _ = task.loss_and_stats(model, batch)
    loss.backward()
    optimizer.step()
    tensors = tuple(_param_state(p, optimizer.state.get(p, {})) for p in params)
    in_units = {id(p) for unit in units(model) for p in unit.parameters()}
    return ModelState(
        parameters=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        optimizer_bytes=sum(t.optimizer_bytes for t in tensors),
        tensors=tensors,
        unit_parameters=max(
            (sum(p.numel() for p in unit.parameters()) for unit in units(model)), default=0
        ),
        root_parameters=sum(p.numel() for p in params if id(p) not in in_units),
    )


def _param_state(param: torch.Tensor, state: dict[str, Any]) -> ParamState:
    per_element = fixed = 0
    for value in state.values():
        if not torch.is_tensor(value):
            continue
        if value.shape == param.shape:
            per_element += value.element_size()
        else:
            fixed += value.numel() * value.element_size()
    return ParamState(
        numel=param.numel(),
        rows=param.shape[0] if param.dim() else 1,
        itemsize=param.element_size(),
        optimizer_bytes_per_element=per_element,
        optimizer_fixed_bytes=fixed,
    )


def saved_bytes(
    model: nn.Module,
    task: Task,
    batch: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    checkpointed: bool,
) -> tuple[int, int]:
    """(bytes autograd keeps for backward after one forward and loss, the most of them saved
    inside one unit). Each storage counts once (views and re-saves share it); parameters are
    model state, not activations."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_unit: dict[int, int] = defaultdict(int)
    current: list[int] = [0]  # id of the unit running now; 0: outside every unit
    inputs: set[int] = set()  # the running unit's inputs: saved inside it, made outside it
    total = 0

    def keep(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() == 0:
            return
        seen.add(ptr)
        total += storage.nbytes()
        per_unit[0 if ptr in inputs else current[0]] += storage.nbytes()

    def enter(unit: nn.Module, args: tuple) -> None:
        tensors = [arg for arg in args if torch.is_tensor(arg)]
        # A checkpointed unit keeps its inputs alive for the recomputation, outside autograd's
        # saved tensors (its own saved-tensor hooks hide the inner ones from ours).
        if checkpointed:
            for tensor in tensors:
                keep(tensor)
        inputs.clear()
        inputs.update(t.untyped_storage().data_ptr() for t in tensors)
        current[0] = id(unit)

    def leave(unit: nn.Module, args: tuple, output: Any) -> None:
        current[0] = 0
        inputs.clear()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(tensor)
        return tensor

    hooks = [unit.register_forward_pre_hook(enter) for unit in units(model)]
    hooks += [unit.register_forward_hook(leave) for unit in units(model)]
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss, _ = task.loss_and_stats(model, batch)
        del loss  # frees the graph and everything it saved
    finally:
        for hook in hooks:
            hook.remove()
    unit_peak = max((n for unit_id, n in per_unit.items() if unit_id), default=0)
    return total, unit_peak


def measure_activations(
    plain: nn.Module,
    checkpointed: nn.Module,
    task: Task,
    columns: dict[str, Any],
    dtype: torch.dtype | None,
) -> dict[bool, Activations]:
    """Activations without (False) and with (True) activation checkpointing (`plain` and
    `checkpointed`: the model in train mode, without and with it applied), each a line through
    two measured batch sizes. The models are only run forward: they come out as they went in."""
    rows = len(next(iter(columns.values())))
    points: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for n in sorted({min(b, rows) for b in PROBE_BATCHES}):
        batch = task.first_rows(columns, n)
        torch.manual_seed(0)  # the same dropout masks for both models
        plain_total, unit_peak = saved_bytes(plain, task, batch, dtype, checkpointed=False)
        torch.manual_seed(0)
        kept, _ = saved_bytes(checkpointed, task, batch, dtype, checkpointed=True)
        points[False].append((n, plain_total))
        # Backward recomputes one unit at a time: its activations come back, once.
        points[True].append((n, kept + unit_peak))
    return {key: _line(pts) for key, pts in points.items()}


def _line(points: list[tuple[int, int]]) -> Activations:
    if len(points) == 1:  # a single training row: all of it per sample
        ((n, y),) = points
        return Activations(fixed=0.0, per_sample=y / n)
    (n1, y1), (n2, y2) = points
    per_sample = max(0.0, (y2 - y1) / (n2 - n1))
    return Activations(fixed=max(0.0, y1 - per_sample * n1), per_sample=per_sample)


# --- extrapolating -------------------------------------------------------------------------


def per_rank(
    strategy: str,
    state: ModelState,
    activation_bytes: int,
    workers: int,
    compute_bytes: int,
    reshard_after_forward: bool,
    device_memory: int,
) -> dict[str, Any]:
    """The fullest rank's bytes under `strategy` (see the module docstring)."""
    p = g = state.param_bytes  # fp32 gradients: one per parameter
    o = state.optimizer_bytes
    gathered = 0
    if strategy == "zero1":
        o = state.zero1_optimizer_bytes(workers)
    elif strategy == "fsdp" and workers > 1:  # one worker: relay.parallel does not shard
        p, o = state.fsdp_rank0_bytes(workers)
        g = p
        at_once = (
            state.root_parameters + state.unit_parameters
            if reshard_after_forward
            else state.parameters
        )
        gathered = at_once * compute_bytes
    model_state = p + g + o + gathered
    total = model_state + activation_bytes
    return {
        "param_bytes": p,
        "gathered_param_bytes": gathered,
        "grad_bytes": g,
        "optimizer_bytes": o,
        "model_state_bytes": model_state,
        "activation_bytes": activation_bytes,
        "total_bytes": total,
        "fits": total <= device_memory,
        "supported": True,
    }


def plan(
    cfg: RunConfig, workers: int, device_memory: int, device_memory_source: str = ""
) -> dict[str, Any]:
    """Measure the configured model and return the report (`relay plan --json`)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    try:
        if cfg.data.from_files:
            from relay.training.data.sources import head

            columns = head(cfg, task)  # a few rows, read here: plan needs no cluster
        else:
            columns = task.load_data(cfg.data.val_fraction, cfg.seed).train
    except (OSError, ValueError) as exc:  # e.g. a data.path that is missing or empty
        message = str(exc)
        named = message if message.startswith("data.") else f"data.path: {message}"
        raise ConfigError(named) from None
    state = measure_model_state(cfg, task, task.first_rows(columns, min(PROBE_BATCHES)))
    fp32_bytes = state.param_bytes // max(state.parameters, 1)

    def build_model() -> nn.Module:
        torch.manual_seed(cfg.seed)
        return task.build_model().train()

    # Built once for every precision (a forward changes no weights): building a large model
    # costs more than measuring it.
    plain, checkpointed = build_model(), build_model()
    apply_activation_checkpointing(checkpointed)
    par = cfg.parallel
    precisions, activations = {}, {}
    for name, dtype in PRECISION_DTYPES.items():
        activations[name] = measure_activations(plain, checkpointed, task, columns, dtype)
        act = activations[name][par.activation_checkpointing].at(cfg.batch_size)
        compute_bytes = dtype.itemsize if dtype is not None else fp32_bytes
        precisions[name] = {
            strategy: per_rank(
                strategy,
                state,
                act,
                workers,
                compute_bytes,
                par.reshard_after_forward,
                device_memory,
            )
            for strategy in STRATEGIES
        }
        if name == "fp16":  # config.py refuses fp16 with fsdp (no loss scaler across shards)
            precisions[name]["fsdp"].update(supported=False, fits=False)
    configured = activations[par.mixed_precision]
    return {
        "task": cfg.task,
        "size": cfg.size,
        "workers": workers,
        "batch_size": cfg.batch_size,
        "strategy": par.strategy,
        "mixed_precision": par.mixed_precision,
        "activation_checkpointing": par.activation_checkpointing,
        "reshard_after_forward": par.reshard_after_forward,
        "device_memory_bytes": device_memory,
        "device_memory_source": device_memory_source,
        "model": {
            "parameters": state.parameters,
            "param_bytes": state.param_bytes,
            "grad_bytes": state.param_bytes,
            "optimizer_bytes": state.optimizer_bytes,
            "optimizer": cfg.optim.name,
        },
        "activation_bytes_per_sample": round(configured[par.activation_checkpointing].per_sample),
        "activation_fixed_bytes": round(configured[par.activation_checkpointing].fixed),
        "activation_bytes_without_checkpointing": configured[False].at(cfg.batch_size),
        "activation_bytes_with_checkpointing": configured[True].at(cfg.batch_size),
        "strategies": precisions[par.mixed_precision],
        "precisions": precisions,
    }


# --- the text report -----------------------------------------------------------------------

_ROWS = (
    ("parameters", "param_bytes"),
    ("gathered params", "gathered_param_bytes"),
    ("gradients", "grad_bytes"),
    ("optimizer state", "optimizer_bytes"),
    ("model state", "model_state_bytes"),
    ("activations", "activation_bytes"),
    ("total", "total_bytes"),
)


def render(report: dict[str, Any]) -> str:
    """The report as a table per rank, strategies side by side."""
    strategies = report["strategies"]
    memory = human_bytes(report["device_memory_bytes"])
    source = f" ({report['device_memory_source']})" if report["device_memory_source"] else ""
    checkpointing = "on" if report["activation_checkpointing"] else "off"
    model = report["model"]
    lines = [
        f"{report['task']} ({report['size']}): {model['parameters']:,} parameters, "
        f"{report['workers']} workers, batch {report['batch_size']} per worker, "
        f"precision {report['mixed_precision']}, activation checkpointing {checkpointing}",
        f"device memory: {memory}{source}",
        "",
        f"{'per rank':<16}" + "".join(f"{name:>14}" for name in STRATEGIES),
    ]
    for label, key in _ROWS:
        cells = (human_bytes(strategies[s][key]) for s in STRATEGIES)
        lines.append(f"{label:<16}" + "".join(f"{cell:>14}" for cell in cells))
    lines.append(
        f"{'fits':<16}"
        + "".join(f"{'yes' if strategies[s]['fits'] else 'NO':>14}" for s in STRATEGIES)
    )
    lines.append("")
    fitting = [s for s in STRATEGIES if strategies[s]["fits"]]
    lines.append(
        f"fits in {memory}: {', '.join(fitting)}"
        if fitting
        else f"nothing fits in {memory}: fewer samples per batch, more workers, bf16, or "
        "activation checkpointing"
    )
    without = human_bytes(report["activation_bytes_without_checkpointing"])
    with_checkpointing = human_bytes(report["activation_bytes_with_checkpointing"])
    lines.append(
        f"activations per micro-batch: {without} without activation checkpointing, "
        f"{with_checkpointing} with it"
    )
    others = [p for p in report["precisions"] if p != report["mixed_precision"]]
    for precision in others:
        totals = report["precisions"][precision]
        lines.append(
            f"with {precision}: "
            + ", ".join(
                f"{s} {human_bytes(totals[s]['total_bytes'])}"
                if totals[s]["supported"]
                else f"{s} not supported"
                for s in STRATEGIES
            )
            + " per rank"
        )
    return "\n".join(lines)
