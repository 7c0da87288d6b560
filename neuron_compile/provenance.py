"""Where a graph node came from: its aten op, input shapes/dtypes and the user's source line.

The same strings name nodes in errors and, through jax named scopes, in the StableHLO locations, so
a complaint about any HLO op can be mapped back to user code.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def describe_value(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val", value.meta.get("example_value"))
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f"{value.layout} "
        return f"{layout}{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]"
    return repr(value)


def describe_inputs(node: torch.fx.Node) -> str:
    parts = [describe_value(a) for a in node.args]
    parts += [f"{k}={describe_value(v)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


# Model libraries whose frames are never the user's line; "kernels" is Hugging Face's kernel hub, whose
# wrappers sit between transformers' layers and their forward.
_LIBRARY_PACKAGES = ("transformers", "diffusers", "kernels", "accelerate", "peft", "torchao")


def _library_dirs() -> tuple[str, ...]:
    """Directories of the packages whose frames are never the user's line (torch, the model libraries)."""
    dirs = [os.path.dirname(torch.__file__)]
    for package in _LIBRARY_PACKAGES:
        try:  # find_spec of a top-level package does not import it
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


_LIBRARY_DIRS: tuple[str, ...] | None = None


@functools.lru_cache(maxsize=4096)
def is_library_file(path: str) -> bool:
    # Cached: asked for every frame of every node's stack trace, and realpath is a few stat calls.
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        _LIBRARY_DIRS = _library_dirs()
    return os.path.realpath(path).startswith(_LIBRARY_DIRS)


def stack_frames(node: torch.fx.Node) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame of the stack trace Dynamo recorded for ``node``, outermost
    first; empty when it recorded none."""
    return [(path, int(line), name) for path, line, name in _FRAME.findall(node.meta.get("stack_trace") or "")]


def user_frame(node: torch.fx.Node) -> tuple[str, int] | None:
    """(file, line) of the innermost frame that produced ``node`` outside torch and the model libraries (the
    user's call of, e.g., a functional collective or a decomposed op), if Dynamo recorded it; the
    innermost frame when every frame is library code."""
    frames = stack_frames(node)
    if not frames:
        return None
    path, line, _ = next((f for f in reversed(frames) if not is_library_file(f[0])), frames[-1])
    return path, line


_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.?")  # how Dynamo names the compiled frame's module: L['self']


def module_path(node: torch.fx.Node) -> str | None:
    """``module layers.0 (TransformerEncoderLayer)``: the innermost ``nn.Module`` the node was traced in.

    Dynamo records no stack trace for code that runs entirely inside torch (a compiled
    ``nn.TransformerEncoder``), but it does record the module path."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    path = _DYNAMO_ROOT.sub("", path)  # L['self'] / L['fn']: the compiled module itself
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return f"module {path or '<root>'} ({name})"


def user_source(node: torch.fx.Node) -> str:
    frame = user_frame(node)
    if frame:
        return f"{frame[0]}:{frame[1]}"
    return module_path(node) or "<unknown source line>"


def scope_name(node: torch.fx.Node) -> str:
    """A jax named-scope label: ``aten.gelu.default#gelu@model.py:42`` ('/' would split the scope)."""
    frame = user_frame(node)
    where = f"@{os.path.basename(frame[0])}:{frame[1]}" if frame else ""
    return f"{op_name(node)}#{node.name}{where}"
