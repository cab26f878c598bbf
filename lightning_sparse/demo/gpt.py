"""A GPT language model in one file (after nanoGPT), and its LightningModule.

Pre-LayerNorm transformer blocks with causal self-attention (``attn.c_attn``, ``attn.c_proj``,
``F.scaled_dot_product_attention``) and an MLP (``mlp.c_fc``, GELU, ``mlp.c_proj``); token and
position embeddings ``transformer.wte`` / ``transformer.wpe``; the output layer ``lm_head``
shares its weight with ``transformer.wte``. Parameter names therefore match nanoGPT / GPT-2
checkpoints, e.g. ``transformer.h.0.mlp.c_fc.weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from lightning_sparse.demo.compiling import compile_in_place, compile_mode
from lightning_sparse.demo.optim import (
    adamw_warmup_cosine,
    check_adamw_warmup_cosine,
    param_groups_weight_decay,
    total_training_steps,
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults are the tiny byte-level CPU model (``"tiny"``).

    Example:
        >>> GPTConfig.preset("gpt2").n_embd, GPTConfig.preset("tiny", n_layer=2).n_layer
        (768, 2)
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"{name}={value!r} is invalid: it must be a positive integer"
                )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: each head gets "
                f"n_embd / n_head channels, pick e.g. n_head={_a_divisor(self.n_embd, self.n_head)}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(
                f"dropout={self.dropout!r} is invalid: it must be in [0, 1)"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration (see :data:`GPT_PRESETS`) with some fields overridden."""
        if name not in GPT_PRESETS:
            raise ValueError(
                f"preset={name!r} is unknown: choose one of {', '.join(map(repr, GPT_PRESETS))}"
            )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"GPTConfig has no field(s) {sorted(unknown)}")
        return replace(GPT_PRESETS[name], **overrides)


def _a_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))


#: Named shapes. ``gpt2``: the 124M-parameter GPT-2 small (GPT-2 BPE vocabulary, 1024 context).
#: ``tiny``: a 0.8M-parameter byte-level model that trains in minutes on a laptop CPU.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "gpt2": GPTConfig(
        vocab_size=50257,
        block_size=1024,
        n_layer=12,
        n_head=12,
        n_embd=768,
        dropout=0.0,
        bias=True,
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``c_attn`` (q, k, v in one matmul) and ``c_proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        q, k, v = (
            t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``c_fc`` (4x wider) -> GELU -> ``c_proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder-only transformer; ``forward(idx)`` returns next-token logits.

    Example:
        >>> import torch
        >>> model = GPT(GPTConfig(n_layer=2, n_embd=64))
        >>> model(torch.randint(0, 256, (2, 10))).shape
        torch.Size([2, 10, 256])
        >>> model.lm_head.weight is model.transformer.wte.weight
        True
        >>> with torch.device("meta"):
        ...     gpt2 = GPT(GPTConfig.preset("gpt2"))
        >>> gpt2.num_params()
        124439808
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1 / sqrt(2 * n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(
                    param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer)
                )

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds block_size={self.config.block_size}"
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` (``(B, T)``)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat(
                [idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)],
                dim=1,
            )
        return idx


class GPTLanguageModel(L.LightningModule):
    """Next-token language modelling with :class:`GPT` (attribute ``model``), AdamW, warmup + cosine.

    The shape is ``preset`` (``"tiny"`` or ``"gpt2"``, see :data:`GPT_PRESETS`) with any of
    ``vocab_size`` ... ``bias`` that are not None overriding it. Parameter names are
    ``model.transformer.h.0.mlp.c_fc.weight`` etc. Weight decay is applied to the 2-D weights of
    the linear layers only (not to biases, LayerNorms, or the embeddings and the tied
    ``lm_head``). Logs ``train/loss``, ``val/loss`` and ``val/ppl`` (torchmetrics Perplexity).
    Batches are ``(x, y)`` int64 ``(B, T)`` with ``y`` the next tokens, as from
    :class:`~lightning_sparse.demo.PydocTextDataModule`.

    Args:
        preset: the starting shape, ``"tiny"`` or ``"gpt2"``.
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias: override the preset's
            field of the same name (see :class:`GPTConfig`).
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the linear layers' weights.
        betas: AdamW betas.
        warmup_steps: linear warmup length: a fraction of the run in [0, 1), or a whole number
            >= 1 of optimizer steps.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        compile: ``torch.compile`` the :class:`GPT` in place in ``configure_model`` (names
            unchanged): ``False`` (eager), ``True`` (the default mode) or a mode such as
            ``"reduce-overhead"`` (see :data:`~lightning_sparse.demo.compiling.COMPILE_MODES`).

    Example:
        >>> import torch
        >>> lm = GPTLanguageModel(n_layer=2, block_size=16)
        >>> x, y = torch.randint(0, 256, (2, 2, 16))
        >>> abs(lm.loss(x, y).item() - math.log(256)) < 0.2  # untrained: about uniform
        True
        >>> lm.config.n_layer, "model.transformer.h.1.mlp.c_fc.weight" in dict(lm.named_parameters())
        (2, True)
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: int | None = None,
        block_size: int | None = None,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        dropout: float | None = None,
        bias: bool | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: float = 0.05,
        min_lr_ratio: float = 0.1,
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        check_adamw_warmup_cosine(lr, weight_decay, warmup_steps, min_lr_ratio)
        compile_mode(compile)
        overrides = {
            "vocab_size": vocab_size,
            "block_size": block_size,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "dropout": dropout,
            "bias": bias,
        }
        self.config = GPTConfig.preset(
            preset, **{k: v for k, v in overrides.items() if v is not None}
        )
        self.save_hyperparameters()
        self.model = GPT(self.config)
        self.val_ppl = Perplexity()

    def configure_model(self) -> None:
        compile_in_place(compile_mode(self.hparams.compile), self.model)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean next-token cross-entropy (nats) of targets ``y`` given inputs ``x``."""
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(*batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.val_ppl(logits.float(), y)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups_weight_decay(
            self, hp.weight_decay, no_decay_modules=(nn.Embedding,)
        )
        return adamw_warmup_cosine(groups, hp, total_training_steps(self.trainer))


__all__ = ["GPT", "GPT_PRESETS", "GPTConfig", "GPTLanguageModel"]
