"""This rank's stage: the module it runs, and the model cut down to it.

The stage module is built from the model's own submodules (the same objects), so the
LightningModule still names every parameter by its path in the whole model: a stage's
checkpoint shards are the whole model's keys, which is what lets torch's DCP reshard a
checkpoint across stage counts and ``raytrain export`` merge the stages. The model's other
submodules with parameters are replaced by ``Dropped`` placeholders, so the rank holds,
optimizes and saves only its stage; submodules without parameters (a torchmetrics
metric, an activation) stay, for the hooks that use them on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from raytrain.pipeline.split import HOOK, SplitError, chain, stage_ranges

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


class ChainStage(nn.Module):
    """A run of the model's children, each given what the one before returned."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        super().__init__()
        self.paths = paths
        self.parts = nn.ModuleList(model.get_submodule(p) for p in paths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class Dropped(nn.Module):
    """Where a submodule of another stage was: no parameters, and a clear error if
    called."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.path} belongs to another pipeline stage; this rank holds only its own "
            "(raytrain.pipeline.stage)"
        )


def stage_module(
    model: nn.Module, mesh: DeviceMesh, split_points: list[str]
) -> tuple[nn.Module, str]:
    """The module this rank's stage runs, and how it was found: the model's own
    ``pipeline_stages(mesh)`` where it defines one, else its forward's chain cut at
    ``split_points`` (``split``)."""
    pipeline = mesh["pipeline"]
    hook = getattr(model, HOOK, None)
    if callable(hook):
        module = hook(mesh)
        if not isinstance(module, nn.Module):
            raise SplitError(f"{type(model).__name__}.{HOOK} returned {type(module).__name__}")
        return module, f"{type(model).__name__}.{HOOK}"
    runs = stage_ranges(chain(model), split_points, pipeline.size())
    mine = runs[pipeline.get_local_rank()]
    return ChainStage(model, mine), f"{mine[0]} .. {mine[-1]}"


def keep_only(model: nn.Module, stage: nn.Module) -> list[str]:
    """Replace each submodule of ``model`` that has parameters, none of them
    ``stage``'s, by a ``Dropped``; returns the paths replaced. A module holding some of
    the stage's parameters is kept and its children looked at in turn."""
    kept = {id(p) for p in stage.parameters()}
    dropped: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            params = [id(p) for p in child.parameters()]
            if not params:
                continue
            path = prefix + name
            if not any(p in kept for p in params):
                setattr(module, name, Dropped(path))
                dropped.append(path)
            elif not all(p in kept for p in params):
                visit(child, path + ".")

    visit(model, "")
    return dropped


def shard_stage(stage: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over the mesh's ``data_parallel`` dimension on the stage (each of its parts a
    unit, then the rest): what ``configure_model`` would do for a model that has none.
    At size 1 too, so the state is DTensors, which Lightning's model-parallel checkpoint
    restore looks for."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for part in getattr(stage, "parts", []):
        if any(True for _ in part.parameters()):
            fully_shard(part, mesh=dp)
    fully_shard(stage, mesh=dp)
