"""Why a function compiles again and again, said while there are compiles left to change the code.

Static shapes mean one compile per input shape (and per Python number, a constant of the graph), and
Dynamo stops at its recompile limit, where this backend makes it raise (``graph_checks``). A smaller last
batch, train and eval, or layers of a few sizes sharing code after a graph break are a few legitimate
compiles; a loop fed every sequence length, or a new learning rate each step, is not.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
import torch._dynamo.config as dynamo_config

from . import provenance
from .errors import NeuronRecompileWarning
from .graph_checks import STATIC_SHAPE_FIX

# frame id -> {frame compile id -> input shapes}; a frame is one function Dynamo compiles.
_shapes_by_frame: dict[int, dict[int, tuple[Any, ...]]] = {}
_warned_frames: set[int] = set()
#: Compiles of one function at which the backend says that each is a full one (new input shapes or new
#: Python numbers): past the few a model legitimately has (a smaller last batch; train and eval; layers of a
#: few sizes sharing the code after a graph break), three compiles before Dynamo's default limit of 8. The
#: shapes it has seen are at most as many as its compiles, so this also bounds the distinct shapes.
COMPILES_BEFORE_RECOMPILE_WARNING = 5
_PYTHON_NUMBER_FIX = (
    "A Python number (an argument, attribute or global that is an int or float) is a constant of the graph: "
    "each new value compiles again. Pass numbers that change from call to call as tensors "
    "(torch.tensor(lr)), or keep them fixed."
)


def warn_recompiles(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Warn once per function that keeps compiling: at its fifth compile, whether for new input shapes or
    for a Python number that changes each call.

    Static shapes mean one compile per shape (and per constant), and Dynamo stops (here: raises) at its
    recompile limit; a training loop whose last batch is smaller compiles twice and is fine, a loop fed
    every sequence length or a new number each step is not. The warning names the inputs whose sizes vary
    and where they are used, or Dynamo's reason for the last recompile, while there are compiles left to
    change the code.
    """
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return
    if compile_id.frame_compile_id == 0:  # a new function (torch._dynamo.reset() numbers frames afresh)
        _shapes_by_frame.pop(compile_id.frame_id, None)
        _warned_frames.discard(compile_id.frame_id)
    if compile_id.frame_id in _warned_frames:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs)
    seen = _shapes_by_frame.setdefault(compile_id.frame_id, {})
    seen[compile_id.frame_compile_id] = shapes
    distinct = list(dict.fromkeys(s for s in seen.values() if len(s) == len(shapes)))
    compiles = compile_id.frame_compile_id + 1
    if compiles < COMPILES_BEFORE_RECOMPILE_WARNING:
        return
    varying, module_sizes_vary = [], False
    for i, node in enumerate(placeholders[: len(shapes)]):
        sizes = list(dict.fromkeys(s[i] for s in distinct))
        if len(sizes) > 1:
            name = _input_name(node)
            module_sizes_vary |= "._parameters[" in name or "._buffers[" in name
            varying.append(
                f"  {name}: shapes {', '.join(str(list(s)) for s in sizes)} "
                f"(used at {provenance.user_source(next(iter(node.users), node))})"
            )
    if module_sizes_vary:
        # The same code run for layers of different sizes (a graph break inside a module's forward makes
        # every layer call one resume function): one compile per layer size, bounded by the model.
        return
    _warned_frames.add(compile_id.frame_id)
    function = _compiled_function(gm)
    where = f"{function[0]} ({function[1]}:{function[2]})" if function else "a function"
    message = (
        f"neuron backend: {where} is compiled for the {_ordinal(compiles)} time; each compile is a full one, "
        f"and after torch._dynamo.config.recompile_limit={dynamo_config.recompile_limit} compiles the next "
        f"raises FailOnRecompileLimitHit. "
    )
    if varying:
        message += (
            f"It has seen {len(distinct)} different sets of input shapes; inputs whose shapes vary:\n"
            + "\n".join(varying)
            + "\n"
            + STATIC_SHAPE_FIX
        )
    else:
        reason = _recompile_reason()
        message += (f"Dynamo's reason for the last recompile: {reason}\n" if reason else "") + _PYTHON_NUMBER_FIX
    # Attributed to the compiled function: the Python stack here is Dynamo's.
    if function is None:
        warnings.warn(message, NeuronRecompileWarning, stacklevel=2)
    else:
        warnings.warn_explicit(message, NeuronRecompileWarning, function[1], function[2])


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _recompile_reason() -> str | None:
    """The failed guard Dynamo gives for this recompile (``n == 2  # f(x, n) ...``), first line only.

    Dynamo records it in its metrics context and only logs it (at the recompile limit); torch has no
    public getter, so this reads the context's dict and gives None if that ever moves."""
    from torch._dynamo.utils import get_metrics_context

    reason = getattr(get_metrics_context(), "_metrics", {}).get("recompile_reason")
    if not isinstance(reason, str) or not reason.strip():
        return None
    guard = reason.strip().splitlines()[0].split("#")[0]  # after '#': Dynamo's source comment
    return re.sub(r"^\d+/\d+: ", "", guard).strip() or None  # and its "frame/compile:" prefix


def _compiled_function(gm: torch.fx.GraphModule) -> tuple[str, str, int] | None:
    """(name, file, line) of the function being compiled: the outermost frame of the graph's stack traces,
    past Dynamo's own wrapper around a compiled module's forward."""
    dynamo_dir = os.path.join(os.path.realpath(os.path.dirname(torch._dynamo.__file__)), "")
    for node in gm.graph.nodes:
        for path, line, name in provenance.stack_frames(node):
            if not os.path.realpath(path).startswith(dynamo_dir):
                return name, path, line
    # Code entirely inside torch (a compiled nn.LSTM) has no stack traces: the root module's forward.
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            cls = list(stack.values())[0][1]
            forward = getattr(cls, "forward", None) if isinstance(cls, type) else None
            code = getattr(forward, "__code__", None)
            if code is not None:
                return f"{cls.__name__}.forward", code.co_filename, code.co_firstlineno
    return None


def _input_name(node: torch.fx.Node) -> str:
    """The input as the user wrote it (``L['kwargs']['cache'].layers[0].keys``), else the node's name."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    return name if isinstance(name, str) else node.name
