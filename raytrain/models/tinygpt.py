"""A small GPT (decoder-only transformer) over bytes: the tinygpt job's model.

Rows are ``tokens``: ``block + 1`` consecutive bytes; the model reads the first ``block`` and
predicts each next byte. Its blocks are ``Block`` modules, the unit FSDP wraps and
activation checkpointing recomputes (``strategy.fsdp.auto_wrap: [Block]``).

Validation reports ``val_bpc`` (bits per character: the mean next-byte cross-entropy in
bits) and ``val_unigram_bpc``, the entropy of the validation bytes' own distribution: what a
model that knows only byte frequencies would score. Both are reduced over every rank.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

VOCAB = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: small normal weights, zero biases. PyTorch's default N(0, 1)
    embedding, used as the tied output head too, starts with a loss near 17 nats, not the
    log(256) = 5.5 of a uniform guess."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(pl.LightningModule):
    """Byte-level GPT: token and position embeddings, ``layers`` blocks, a tied head."""

    def __init__(
        self,
        block: int = 128,
        layers: int = 4,
        heads: int = 4,
        dim: int = 128,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.val_loss = MeanMetric()
        self._byte_counts = torch.zeros(VOCAB, dtype=torch.float64)
        # Lightning's convention for a model's input: MLflow's signature and input example
        self.example_input_array = torch.zeros(1, block, dtype=torch.long)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tok.weight.t()  # tied with the token embedding

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.long()
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch["tokens"])
        self.log("train_loss", loss, batch_size=len(batch["tokens"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        tokens = batch["tokens"]
        self.val_loss.update(self._loss(tokens), weight=tokens[:, 1:].numel())
        counts = torch.bincount(tokens[:, 1:].reshape(-1).long().cpu(), minlength=VOCAB)
        self._byte_counts += counts.double()

    def on_validation_epoch_end(self) -> None:
        nats = self.val_loss.compute()  # reduced over every rank
        self.val_loss.reset()
        counts = self._byte_counts.to(self.device)
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        self._byte_counts = torch.zeros(VOCAB, dtype=torch.float64)
        p = counts[counts > 0] / counts.sum()
        self.log("val_loss", nats)
        self.log("val_bpc", nats / math.log(2))
        self.log("val_unigram_bpc", float(-(p * p.log2()).sum()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # By name, not shape: under FSDP a parameter may be a flat shard of any shape.
        def no_decay(name: str) -> bool:
            return name.endswith("bias") or "norm" in name or name.startswith("pos")

        decay = [p for n, p in self.named_parameters() if not no_decay(n)]
        rest = [p for n, p in self.named_parameters() if no_decay(n)]
        groups = [
            {"params": decay, "weight_decay": self.hparams["weight_decay"]},
            {"params": rest, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams["lr"], betas=(0.9, 0.95))
