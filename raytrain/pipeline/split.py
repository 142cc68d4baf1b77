"""Where a model is cut into pipeline stages.

A model needs no pipeline code when its ``forward`` is a chain: it passes its one input
through a sequence of its children (a ``ModuleList``'s items count one by one), each
taking the tensor the one before returned, and returns what the last returned. That chain
is found by tracing the forward with ``torch.fx`` (every child a leaf); a cut may fall
before any link but the first. A model whose forward is not such a chain (it adds two
children's outputs, reads a parameter itself, calls a child twice) is refused with the
link that breaks it, unless it defines ``pipeline_stages(mesh)`` and cuts itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

HOOK = "pipeline_stages"


class SplitError(ValueError):
    """A model that cannot be cut as asked; the message names the module path and why."""


def chain(model: nn.Module) -> list[str]:
    """The module paths of the children ``model.forward`` passes its input through, in
    order (``["embed", "blocks.0", "blocks.1", "head"]``). Raises ``SplitError`` naming
    what breaks the chain."""
    import torch.fx

    class _Children(torch.fx.Tracer):
        def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
            return qualified_name != "" and not _is_container(module)

    try:
        graph = _Children().trace(model)
    except Exception as exc:  # fx refuses data-dependent control flow, *args, ...
        raise SplitError(
            f"{type(model).__name__}.forward could not be traced to find its children "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); define "
            f"{HOOK}(mesh) to cut it yourself"
        ) from exc
    return _links(graph, type(model).__name__)


def _is_container(module: nn.Module) -> bool:
    from torch import nn

    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _links(graph: object, name: str) -> list[str]:
    """The chain in an fx graph: one placeholder, then ``call_module`` nodes each taking
    exactly the node before, then the output of the last."""
    nodes = list(graph.nodes)  # type: ignore[attr-defined]
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise SplitError(
            f"{name}.forward takes {len(inputs)} inputs; a pipeline passes one tensor "
            f"between stages: define {HOOK}(mesh)"
        )
    order: list[str] = []
    previous = inputs[0]
    for node in nodes[1:]:
        if node.op == "output":
            if node.args[0] is not previous:
                raise SplitError(
                    f"{name}.forward does not return what its last child "
                    f"({order[-1] if order else 'none'}) returned: define {HOOK}(mesh)"
                )
            break
        where = node.target if node.op == "call_module" else f"{node.op} {node.target}"
        if node.op != "call_module" or node.args != (previous,) or node.kwargs:
            raise SplitError(
                f"{name}.forward does not pass one tensor from one child to the next: at "
                f"{where} (after {order[-1] if order else 'its input'}); a split needs a "
                f"forward that is a chain of children, else define {HOOK}(mesh)"
            )
        if node.target in order:
            raise SplitError(f"{name}.forward calls {node.target} twice: define {HOOK}(mesh)")
        order.append(str(node.target))
        previous = node
    return order


def stage_ranges(links: list[str], split_points: list[str], stages: int) -> list[list[str]]:
    """``links`` cut into ``stages`` runs: at ``split_points`` (each begins a run), or,
    with none given, into runs of equal length (the first ones one longer).

    Invariant: the runs, concatenated, are ``links`` in order, and there are ``stages`` of
    them, none empty. A split point not in ``links``, one at the first link, points out
    of order, or more stages than links raise ``SplitError`` naming the point."""
    if stages > len(links):
        raise SplitError(
            f"{stages} stages, but the model's forward calls only {len(links)} children "
            f"({', '.join(links)})"
        )
    if not split_points:
        size, extra = divmod(len(links), stages)
        starts = [i * size + min(i, extra) for i in range(stages)]
    else:
        starts = [0]
        for point in split_points:
            if point not in links:
                raise SplitError(
                    f"split point {point!r}: no such child in the chain the model's forward "
                    f"calls ({', '.join(links)})"
                )
            at = links.index(point)
            if at <= starts[-1]:
                raise SplitError(
                    f"split point {point!r}: "
                    + ("the first stage begins there already" if at == 0 else "out of order")
                )
            starts.append(at)
    ends = [*starts[1:], len(links)]
    return [links[a:b] for a, b in zip(starts, ends, strict=True)]
