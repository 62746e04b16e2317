"""What the language-model tasks (charlm, hf-causal-lm) share: the next-token loss and its
statistics, perplexity, and how served prompts are grouped into generations."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from relay.tasks.base import Batch

# Below this temperature sampling is greedy decoding: logits / t would overflow float32 as t → 0,
# and the limit of sampling at t → 0 is the argmax anyway.
MIN_SAMPLING_TEMPERATURE = 1e-4


def next_token_loss(
    logits: torch.Tensor, tokens: torch.Tensor, unit: str
) -> tuple[torch.Tensor, Batch]:
    """Mean cross-entropy of `logits` (for tokens[:, :-1]) against tokens[:, 1:], and the sums
    the metrics need: sequences ("count"), predicted tokens (`unit`) and the loss summed over
    them."""
    targets = tokens[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    predicted = float(targets.numel())
    stats = {
        "count": torch.tensor(float(len(tokens))),
        unit: torch.tensor(predicted),
        "loss_sum": loss.detach() * predicted,
    }
    return loss, stats


def per_token_metrics(sums: dict[str, float], unit: str) -> dict[str, float]:
    loss = sums["loss_sum"] / max(sums[unit], 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def generations(
    instances: Sequence[Any], prompts: list[list[int]]
) -> Iterator[tuple[list[int], torch.Tensor, int, float, torch.Generator | None]]:
    """The generations that serve `instances` (each with max_new_tokens, temperature and an
    optional seed; `prompts` their token ids), as (members, prompt tokens, max_new_tokens,
    temperature, generator).

    Instances share one generation when their prompts have one length (the models have no
    padding mask) and they ask the same max_new_tokens and temperature without a seed; a
    seeded instance runs alone with its own generator, so its text does not depend on what it
    was batched with. A temperature below MIN_SAMPLING_TEMPERATURE comes out as 0 (greedy)."""
    groups: dict[tuple, list[int]] = {}
    for i, (instance, prompt) in enumerate(zip(instances, prompts, strict=True)):
        solo = i if instance.seed is not None else None
        key = (len(prompt), instance.max_new_tokens, instance.temperature, solo)
        groups.setdefault(key, []).append(i)
    for (_, max_new_tokens, temperature, _), members in groups.items():
        seed = instances[members[0]].seed
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens = torch.tensor([prompts[i] for i in members], dtype=torch.long)
        greedy = temperature < MIN_SAMPLING_TEMPERATURE
        yield members, tokens, max_new_tokens, 0.0 if greedy else temperature, generator
