"""A small byte-level decoder-only transformer (GPT) for tests, the demo and benchmarks.

The architecture is the pre-norm GPT-2 layout (Radford et al., 2019, "Language Models are
Unsupervised Multitask Learners"; the decoder-only transformer of Vaswani et al., 2017,
"Attention Is All You Need"): learned token and position embeddings, ``n_layer`` blocks of
causal self-attention and a GELU MLP each behind a LayerNorm with a residual connection, a final
LayerNorm and a language-model head tied to the token embedding. The vocabulary is the 256 byte
values, so no tokenizer is needed.

Why it is built the way it is:

* Peers must start from bit-identical parameters without talking to each other, so
  :class:`GPT` draws every initial value from its own ``torch.Generator`` seeded by ``seed``.
  The modules are first created on the ``meta`` device (no storage, no random draws) and then
  materialised and filled explicitly, so construction never reads or advances the caller's global
  RNG and is safe to run from several threads at once (the in-process test groups do that).
* Dropout defaults to 0: every peer must compute the same thing from the same inputs.
* Attention uses :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True``,
  so no mask buffer is stored (nothing but parameters ends up in the state dict).

The default size (:meth:`GPTConfig.default`) is sized for one thread per peer on a small CPU
machine (docs/BENCHMARKS.md, "The demo's model: one training step on one thread").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "PRESETS", "GPTConfig"]

PRESETS = ("tiny", "default", "medium")
"""The names :meth:`GPTConfig.preset` accepts, smallest first."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. Every field must be positive; construction raises ``ValueError``
    naming the field and what to change otherwise."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    block_size: int
    """Longest sequence the model accepts (size of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    dropout: float = 0.0
    """Dropout probability in training mode. Keep 0 for distributed runs: peers must compute
    identical things, and dropout draws from the global RNG of each process."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (saves ``vocab_size * d_model`` params)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            # bool is an int subclass; GPTConfig(n_layer=True) is surely a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of d_model"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def default(cls) -> GPTConfig:
        """The demo's model: 1,288,640 parameters, block 64, 4 layers, 4 heads, width 160.

        Sized for ``torch.set_num_threads(1)``, because the demo runs three peers on two cores:
        a context of 64 rather than 128 halves the time of a training step at batch 16 while
        keeping the model's width and depth (docs/BENCHMARKS.md, "The demo's model: one
        training step on one thread")."""
        return cls(block_size=64, n_layer=4, n_head=4, d_model=160)

    @classmethod
    def tiny(cls) -> GPTConfig:
        """A few tens of thousands of parameters (about 34k), block 32: for fast unit tests."""
        return cls(block_size=32, n_layer=2, n_head=2, d_model=32)

    @classmethod
    def medium(cls) -> GPTConfig:
        """A model whose synchronization a thin link feels: 10,770,432 parameters (43 MB of
        fp32), block 64, 6 layers, 6 heads, width 384.

        The block is the default's, so the same batches and token budget train either. Sized
        for comparing synchronization on thin links: a full fp32 synchronization of it over a
        10 Mbit/s link outlasts many of its training steps, while four peers can still train it
        on a small CPU machine (docs/BENCHMARKS.md, "A larger model on a thin link")."""
        return cls(block_size=64, n_layer=6, n_head=6, d_model=384)

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """The named preset: one of :data:`PRESETS` (``tiny``, ``default``, ``medium``).
        Raises ``ValueError`` naming the presets for any other name."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; pick one of {', '.join(PRESETS)}")
        return getattr(cls, name)()

    def to_dict(self) -> dict[str, int | float | bool]:
        return asdict(self)


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # [B, T, 3C] -> three [B, H, T, C/H] tensors
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``GPT(cfg, seed=s)`` gives bitwise-identical parameters for the same
    ``(cfg, s)`` in any process, and leaves the global RNG untouched.

    Raises ``TypeError`` if ``config`` is not a :class:`GPTConfig` or ``seed`` is not an int.
    """

    def __init__(self, config: GPTConfig, *, seed: int) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(config).__name__}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"GPT seed must be an int, got {seed!r}")
        self.config = config
        # Built on meta so that nn.Linear's own reset_parameters draws nothing from the global
        # RNG; every value is then written by _init_weights from a private generator.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.block_size, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.to_empty(device=torch.device("cpu"))
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        std = 0.02
        # GPT-2: residual-branch output projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth.
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        seen: set[int] = set()
        # named_parameters() visits parameters in definition order and yields a tied tensor
        # once, so the draw order (and hence every value) is fixed by the config alone.
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.endswith(".bias"):
                p.zero_()
            elif name.startswith("ln_f.") or ".ln" in name:  # LayerNorm gains
                p.fill_(1.0)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                p.normal_(0.0, resid_std, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, T, vocab]`` for int64 ids ``idx [B, T]``, and the mean cross entropy
        against ``targets [B, T]`` when given (else ``None``).

        Raises ``ValueError`` if ``idx`` is not 2-D integer, ``T`` exceeds ``block_size`` or
        ``targets`` has another shape; ids outside ``[0, vocab_size)`` raise from the embedding.
        The loss is returned as computed: callers that share gradients must check it is finite
        (a diverged model yields NaN/Inf here, it is not hidden).
        """
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"GPT input must be a 2-D int64 tensor [batch, time], got {tuple(idx.shape)} "
                f"{idx.dtype}"
            )
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.config.block_size}; "
                f"crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        if targets.shape != idx.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} must equal input shape {tuple(idx.shape)}"
            )
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1).long())
        return logits, loss
