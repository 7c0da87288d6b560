"""One-op graphs: a function of a few tensors traced on its own (static shapes, our decomposition table) and
compiled through the compiler, kept in one in-memory table (``GRAPHS``) by a key its caller chooses. Eager
ops (``eager.py``) and the device's gathers and scatters of views (``context.py``) are such graphs."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import NeuronUnsupportedOpError
from ..options import Options


@dataclass
class OpGraph:
    """A compiled one-op graph and how many of its outputs are the op's own results (the rest are the new
    values of the arguments it writes, in order); ``layout``: per result of the op, -1 for one tensor or the
    length of a list of them (``_foreach_*`` ops return lists)."""

    graph: Callable[[list[Any]], list[Any]]
    num_results: int
    layout: list[int] = field(default_factory=lambda: [-1])
    #: The numbers the op was given that the graph takes as inputs (``operands.Lifted``), after the tensors.
    operands: Any = None


#: Compiled one-op graphs (or the refusal of one that cannot be compiled) by key, for the process.
GRAPHS: dict[Any, OpGraph | NeuronUnsupportedOpError | str] = {}
GRAPHS_LOCK = threading.RLock()


def example(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """What a one-op graph's input is traced as: its shape and dtype (made into a tensor by ``trace``)."""
    return tuple(int(s) for s in t.shape), t.dtype


def outside_any_trace() -> Any:
    """A context free of whatever traces the caller (Dynamo runs an optimizer's ``_init_group`` on real
    tensors under its own fake mode): a one-op graph is traced and compiled on its own, with static shapes."""
    import contextlib

    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    stack = contextlib.ExitStack()
    stack.enter_context(tracing(None))
    stack.enter_context(unset_fake_temporarily())
    return stack


def trace(fn: Callable[..., Any], examples: list[tuple[tuple[int, ...], torch.dtype]]) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..decompositions import decomposition_table

    with outside_any_trace():
        mode = FakeTensorMode()  # static shapes: no ShapeEnv
        with mode:
            fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in examples]
            return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), decomposition_table())(*fakes)


def compile_one(gm: torch.fx.GraphModule, op: Any, opts: Options) -> Callable[[list[Any]], list[Any]]:
    from ..compiler import build_artifact, compile_graph

    if opts.precompile_manifest:  # precompile collect: an eager op may come before the backend's first compile
        from ..cache.collect import start_collecting

        start_collecting(build_artifact)

    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    name = f"eager_{str(op).replace('.', '_')}"
    with outside_any_trace():
        return compile_graph(gm, fakes, opts=opts, kind="inference", name=name)


def check_lowers(gm: torch.fx.GraphModule, op: Any, opts: Options) -> None:
    """Lower a copy of ``gm`` as ``compile_one`` would, without compiling it: raises what ``compile_one`` would
    raise for an op the device refuses (the lazy mode checks each op when it is called, then compiles the
    recorded sequence as one graph)."""
    from ..compiler import build_artifact
    from ..value_checks import split_value_checks

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    copy = torch.fx.GraphModule(gm, graph)
    split_value_checks(copy, index_bounds=True)
    fakes = [n.meta["val"] for n in copy.graph.nodes if n.op == "placeholder"]
    name = f"eager_{str(op).replace('.', '_')}"
    with outside_any_trace():
        build_artifact(copy, fakes, opts, name, compile=False, background=False)


_TENSOR_STR = os.path.join("torch", "_tensor_str.py")


def printing(depth: int = 16) -> bool:
    """Whether torch is formatting a tensor for print/repr (``torch/_tensor_str.py`` is a caller): the values go
    to the host anyway, and the formatter works in float64 and with data-dependent shapes, which the device
    has not, so its ops run on the host, silently."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        if frame.f_code.co_filename.endswith(_TENSOR_STR):
            return True
        frame = frame.f_back
        depth -= 1
    return False


_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_OUTSIDE: dict[str, bool] = {}


def user_line() -> str:
    """``file:line`` of the innermost caller outside torch and this package (the user's code). Walks the frames
    (no source lines read): the lazy mode asks it at every recorded op."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        outside = _OUTSIDE.get(filename)
        if outside is None:
            path = os.path.abspath(filename)
            outside = _OUTSIDE[filename] = not (
                path.startswith(_DIR) or path.startswith(_TORCH_DIR) or "<frozen" in path
            )
        if outside:
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown source line>"
