"""A small GPT (decoder-only transformer) over bytes: the tinygpt job's model.

Rows are ``tokens``: ``block + 1`` consecutive bytes; the model reads the first ``block`` and
predicts each next byte. Its blocks are ``Block`` modules, the unit FSDP wraps and
activation checkpointing recomputes (``strategy.fsdp.auto_wrap: [Block]``).

Under ``strategy.name: model_parallel`` its ``configure_model`` applies a tensor-parallel
plan over the mesh's ``tensor_parallel`` dimension and FSDP2 over ``data_parallel`` (see
``parallelize``); under DDP and FSDP it does nothing.

Validation reports ``val_bpc`` (bits per character: the mean next-byte cross-entropy in
bits) and ``val_unigram_bpc``, the entropy of the validation bytes' own distribution: what a
model that knows only byte frequencies would score. Both are reduced over every rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

VOCAB = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP.

    ``head_qkv``'s output features are grouped by head (head 0's query, key and value, then
    head 1's, ...), so a column-wise shard of it (tensor parallelism) holds whole heads: a
    rank computes the attention of its heads alone, and ``attend`` reads the number of heads
    from the features it got. (It was ``qkv``, features grouped query | key | value: the
    new name makes a checkpoint of that layout fail to load instead of loading into the
    other layout unnoticed.)
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.head_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = dropout

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of the normalised ``h`` (this rank's heads, projected)."""
        qkv = self.head_qkv(h)  # (b, t, 3 x this rank's heads x head_dim)
        b, t, features = qkv.shape  # t: the whole sequence, also under sequence parallelism
        heads = features // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: small normal weights, zero biases. PyTorch's default N(0, 1)
    embedding, used as the tied output head too, starts with a loss near 17 nats, not the
    log(256) = 5.5 of a uniform guess."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def parallelize(model: TinyGPT, mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Shard ``model`` over a (``data_parallel``, ``tensor_parallel``) device mesh, as
    Lightning's ``ModelParallelStrategy`` builds it; each part only where its size is > 1.

    Tensor parallelism (Megatron's plan): in every block, ``head_qkv`` and the MLP's first
    layer are split column-wise (each rank computes its heads and its share of the hidden
    features, from the whole input), ``proj`` and the MLP's second layer row-wise (each rank
    multiplies its share and the results are summed across the ranks). One all-reduce per
    attention and one per MLP, forward and backward. With ``sequence_parallel`` the blocks'
    layer norms and the residual stream between them are split along the sequence instead
    of repeated on every rank: each all-reduce becomes a reduce-scatter and an all-gather
    (the same bytes), and the norms' activations take 1/tp of the memory. The embeddings,
    the final norm and the tied head stay whole on every rank: 256 x dim, small beside the
    blocks. FSDP2 (``fully_shard``) then shards every block, and the rest as one unit,
    across ``data_parallel``.

    Under a pipeline (a ``pipeline`` dimension in the mesh) the same is done to the blocks
    this rank's stage holds, and FSDP2's root is the stage (``pipeline_stages``), which is
    what the pipeline calls.
    """
    from torch.distributed.fsdp import fully_shard

    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    blocks = [b for b in model.blocks if isinstance(b, Block)]  # this stage's, if cut
    stage = model.__dict__.get("pipeline_stage")
    if tp.size() > 1:
        _check_tensor_parallel(model, tp.size(), sequence_parallel)
        _tensor_parallel(model, blocks, tp, sequence_parallel)
        if stage is not None:
            stage.sequence_shards = model.sequence_shards
    if dp.size() > 1 or tp.size() == 1:  # alone (a world of 1) too: its state is DTensors,
        for part in blocks:  # which Lightning's model-parallel restore looks for
            fully_shard(part, mesh=dp)
        fully_shard(model if stage is None else stage, mesh=dp)


def _check_tensor_parallel(model: TinyGPT, tp: int, sequence_parallel: bool) -> None:
    """Each rank computes whole heads, and sequence parallelism splits the block by ``tp``."""
    heads, block = model.hparams["heads"], model.hparams["block"]
    if heads % tp:
        raise ValueError(
            f"model.init_args.heads: {heads} is not a multiple of strategy.model_parallel."
            f"tensor_parallel_size ({tp}): each rank computes whole heads"
        )
    if sequence_parallel and block % tp:
        raise ValueError(
            f"model.init_args.block: {block} is not a multiple of strategy.model_parallel."
            f"tensor_parallel_size ({tp}), which sequence parallelism splits it by; "
            "set model.init_args.sequence_parallel: false"
        )


def _tensor_parallel(
    model: TinyGPT, blocks: list[Any], tp: DeviceMesh, sequence_parallel: bool
) -> None:
    """Megatron's plan on every block over ``tp`` (see ``parallelize``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model.sequence_shards = tp.size() if sequence_parallel else 1
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "head_qkv": ColwiseParallel(input_layouts=seq),
        "proj": RowwiseParallel(output_layouts=seq),
        "mlp.0": ColwiseParallel(input_layouts=seq),
        "mlp.2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
        # the residual stream enters the first block whole and leaves the last whole
        enter = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        leave = PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
        )
        parallelize_module(blocks[0], tp, enter)
        parallelize_module(blocks[-1], tp, leave)
    for block in blocks:
        parallelize_module(block, tp, plan)


def _check_sequence(tokens: int, shards: int) -> None:
    if tokens % shards:
        raise ValueError(
            f"TinyGPT: a sequence of {tokens} tokens; under sequence parallelism it must be a "
            f"multiple of the tensor-parallel size ({shards})"
        )


class GPTStage(nn.Module):
    """One pipeline stage of a ``TinyGPT``, built from its own modules: the embeddings on
    the first stage, a run of blocks, and on the last the final norm and the output head,
    which is tied to the token embedding, so the last stage holds ``tok`` too (the
    pipeline sums the two copies' gradients, ``pipeline.runner``). Takes token ids or the
    residual stream, returns the residual stream or the logits."""

    def __init__(self, gpt: TinyGPT, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tok = gpt.tok if first or last else None
        self.pos = gpt.pos if first else None
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.norm = gpt.norm if last else None
        self.sequence_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos is not None and self.tok is not None:
            _check_sequence(x.shape[1], self.sequence_shards)
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.tok is not None:
            x = self.norm(x) @ self.tok.weight.t()
        return x


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
        sequence_parallel: bool = True,
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
        self.sequence_shards = 1  # what sequence parallelism splits a sequence into

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (a device mesh): the tensor-parallel plan and
        FSDP2 (``parallelize``). Lightning may call it again (a validate after fit): a model
        already parallelized is left as it is."""
        from torch.distributed.tensor import DTensor

        if self.device_mesh is None or any(isinstance(p, DTensor) for p in self.parameters()):
            return
        parallelize(self, self.device_mesh, self.hparams["sequence_parallel"])

    def pipeline_stages(self, mesh: DeviceMesh) -> GPTStage:
        """This rank's stage of a pipeline over ``mesh["pipeline"]``: the blocks in equal
        runs (the first stages one more where they do not divide), the embeddings with the
        first, the norm and head with the last. Kept (unregistered, so not in the state)
        for ``configure_model``, which shards the stage."""
        pipeline = mesh["pipeline"]
        stage, stages = pipeline.get_local_rank(), pipeline.size()
        layers = len(self.blocks)
        if stages > layers:
            raise ValueError(
                f"model.init_args.layers: {layers} blocks cannot fill {stages} pipeline "
                "stages (strategy.model_parallel.pipeline_parallel_size)"
            )
        size, extra = divmod(layers, stages)
        start = stage * size + min(stage, extra)
        blocks = list(range(start, start + size + (stage < extra)))
        module = GPTStage(self, blocks, first=stage == 0, last=stage == stages - 1)
        self.__dict__["pipeline_stage"] = module
        return module

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        _check_sequence(t, self.sequence_shards)
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
