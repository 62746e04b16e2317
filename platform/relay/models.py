"""Model architectures only: plain nn.Modules, no distribution concerns (see relay/parallel/).

Initialisation is per module and seeded by the module's name (`init_seeded`): each module that
owns parameters draws them from its own generator, seeded from the run's seed and its name,
never from a stream shared with the modules built before it. So a module can be initialised on
its own, in any order, and come out the same — which is what lets fsdp build a model on the
`meta` device and materialise only its rank's shards, one module at a time, equal to what
building the whole model would give (parallel/fsdp.py).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn


def module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def modules_to_init(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters, by name; a tied parameter belongs to the first."""
    seen: set[int] = set()
    owners = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if own:
            owners.append((name, module))
            seen.update(id(p) for p in own)
    return owners


def init_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """(Re)initialise `module`'s own parameters as `model` initialises it (its `init_module`
    rule, else the module's `reset_parameters`), from a generator seeded by its name and the
    seed the model was built under (`model.init_seed`). The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(model.init_seed, name))
        if hasattr(model, "init_module"):
            model.init_module(name, module)
        else:
            module.reset_parameters()


def init_seeded(model: nn.Module) -> None:
    """Initialise every parameter of `model`, module by module (see the module docstring)."""
    model.init_seed = torch.initial_seed()  # what torch.manual_seed last set
    for name, module in modules_to_init(model):
        init_module(model, name, module)


def seeded(model: nn.Module) -> bool:
    """Whether `model` was initialised by `init_seeded`, so a module can be re-made alone."""
    return hasattr(model, "init_seed")


class MLP(nn.Module):
    """A feed-forward net; `input_scale` folds input normalisation into the model itself, so
    a served model takes raw inputs exactly as the data set has them."""

    def __init__(
        self,
        in_features: int,
        hidden: list[int],
        out_features: int,
        dropout: float = 0.0,
        input_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.input_scale = input_scale
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.GELU(), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)
        init_seeded(self)  # nn.Linear's own rule, per module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.input_scale)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block; the unit FSDP-style strategies shard by."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A small GPT: token + position embeddings, causal blocks, tied output head."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        d_model: int,
        n_layer: int,
        n_head: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.block_size = block_size
        self.n_layer = n_layer
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        init_seeded(self)

    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2's rule: N(0, 0.02) weights, zero biases, and the projections back into the
        residual stream scaled down by sqrt(2 * n_layer)."""
        if isinstance(module, nn.Linear):
            residual = name.endswith(("attn.proj", "mlp.2"))
            std = 0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        else:
            module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, generator=None
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.block_size :])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens
