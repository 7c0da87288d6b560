"""The cache key of one AOTAutograd graph: ONE function, ``cache_key``, computes it.

What enters the key, and why:
- a canonical form of the graph: nodes by position (never by name), op targets by their qualified op
  name, literal arguments tagged by type, constants (``get_attr`` tensors) by their bytes and nested
  graph modules by their own canonical form. Node names, ``get_attr`` names, module paths, stack traces
  and other ``node.meta`` never enter, so identical blocks under different module paths share an entry;
- every input's dtype, shape, stride, device type and requires_grad (and static Python inputs by value);
- the options that change the artifact (``Options.cache_relevant``), the target, and versions of torch,
  neuron_compile (plus a fingerprint of its source, so an edited lowering never reuses an old artifact),
  jax/jaxlib, and neuronx-cc and the real nki when the neuron target is used (``XLA_FLAGS`` for the CPU
  target);
- the user tag ``torch.compiler.config.cache_key_tag``.

The key is the hash of its summary (``key_digest``), which names the graph by its own digest: so a key can
be recomputed from a summary alone (``neuron-compile precompile`` fills in the compiling host's neuronx-cc
version) and two summaries compared part by part (``key_differences``: why did this miss).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..artifact import SAVED_FOR_BACKWARD_FROM
from ..graph_checks import is_symbolic
from ..options import Options
from ..runtime import neuronx_cc

#: Bumped when the key or entry format changes incompatibly.
KEY_FORMAT = 3  # 2: outputs that alias inputs (OutputSpec kind "input"); 3: the graph's digest in the summary


class NotCacheable(Exception):
    """The graph holds something we cannot key faithfully (a fake constant, a SymInt, an opaque object)."""


@dataclass(frozen=True)
class CacheKey:
    """The key (hex digest) plus a human-readable summary of what went into it (kept in the entry)."""

    digest: str
    summary: dict[str, Any]


def _target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.name()}"
    if isinstance(target, str):  # call_method
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if module is None or qualname is None:
        raise NotCacheable(f"node target {target!r} has no stable name")
    return f"{module}.{qualname}"


def _tensor_fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """A constant baked into the graph enters the key by value (bytes), not by its attribute name."""
    if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
        raise NotCacheable("graph holds a constant tensor without data (fake or meta)")
    if t.layout != torch.strided or t.is_quantized:
        raise NotCacheable(f"graph holds a {t.layout} / {t.dtype} constant (no plain bytes to hash)")
    # compile time runs under the graph's FakeTensorMode; reading a real constant's bytes must not
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
        # Bytes through uint8, never through numpy's view of the dtype: numpy has no bfloat16/float8, and
        # an empty tensor keeps its dtype (the crash of issue 11 was an empty bf16 constant).
        data = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(-1, 1).view(torch.uint8)
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return ("tensor", str(t.dtype), tuple(t.shape), tuple(t.stride()), digest)


def _canon_value(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    # bool before int: True == 1 would otherwise collide.
    if isinstance(value, torch.fx.Node):
        return ("n", index[value])
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, float):
        return ("f", value.hex())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canon_value(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), _canon_value(v, index)) for k, v in sorted(value.items())))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, str(value))
    if isinstance(value, slice):
        return ("slice", _canon_value((value.start, value.stop, value.step), index))
    if value is Ellipsis:
        return ("...",)
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return ("op", _target_name(value))
    if is_symbolic(value):
        raise NotCacheable("graph holds a symbolic size")
    if isinstance(value, torch.Tensor):
        return _tensor_fingerprint(value)
    raise NotCacheable(f"graph argument of type {type(value).__name__} has no canonical form")


def _resolve_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def canonical_graph(gm: torch.fx.GraphModule) -> tuple[Any, ...]:
    """The graph as a nested tuple of primitives: equal for graphs that compute the same thing."""
    index: dict[torch.fx.Node, int] = {}
    rows: list[Any] = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            rows.append(("p",))
        elif node.op == "get_attr":
            obj = _resolve_attr(gm, node.target)
            if isinstance(obj, torch.fx.GraphModule):
                rows.append(("a", canonical_graph(obj)))
            elif isinstance(obj, torch.Tensor):
                rows.append(("a", _tensor_fingerprint(obj)))
            else:
                raise NotCacheable(f"get_attr of {type(obj).__name__}")
        elif node.op in ("call_function", "call_method"):
            rows.append(
                (
                    node.op[5],
                    _target_name(node.target),
                    _canon_value(node.args, index),
                    _canon_value(node.kwargs, index),
                )
            )
        elif node.op == "call_module":
            sub = _resolve_attr(gm, node.target)
            if not isinstance(sub, torch.fx.GraphModule):
                raise NotCacheable(f"call_module of {type(sub).__name__}")
            rows.append(("c", canonical_graph(sub), _canon_value(node.args, index), _canon_value(node.kwargs, index)))
        elif node.op == "output":
            rows.append(("o", _canon_value(node.args, index)))
        else:
            raise NotCacheable(f"unknown node kind {node.op}")
    return tuple(rows)


def input_signature(example_inputs: list[Any]) -> list[str]:
    """One readable string per graph input, e.g. ``float32[4, 8] stride=(8, 1) cpu grad``."""
    sig = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            grad = " grad" if x.requires_grad else ""
            sig.append(
                f"{str(x.dtype).replace('torch.', '')}{list(x.shape)} stride={tuple(x.stride())} {x.device.type}{grad}"
            )
        elif is_symbolic(x):
            raise NotCacheable("symbolic input")
        elif x is None or isinstance(x, (bool, int, float, str)):
            sig.append(f"{type(x).__name__}={x.hex() if isinstance(x, float) else x!r}")
        else:
            raise NotCacheable(f"graph input of type {type(x).__name__}")
    return sig


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over neuron_compile's own source: a lowering edited in place must not hit old entries."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _neuronx_cc_version(generation: str) -> str:
    from ..runtime.neuron import NeuronTarget

    return NeuronTarget(generation).version()


def nki_version() -> str:
    """The version of the real ``nki`` package the neuron target compiles NKI kernels with; "none" when it is
    not installed or ``NEURON_COMPILE_NKI=emulator`` keeps it unused (as ``kernels/nki_api.py`` decides).

    Read from the installed distribution's metadata: importing nki (or the emulator) would cost every cache
    hit its import time. (The public index's placeholder ``nki``, which nki_api does not use, reports its own
    version: the same in every run, so harmless.)
    """
    if os.environ.get("NEURON_COMPILE_NKI", "").lower() == "emulator":
        return "none"
    return _installed_nki_version()


@functools.lru_cache(maxsize=1)
def _installed_nki_version() -> str:
    try:
        return importlib.metadata.version("nki")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def package_versions(target: str, generation: str) -> dict[str, str]:
    """Versions of everything that shapes the artifact."""
    import jax
    import jaxlib

    from ..version import __version__

    versions = {
        "torch": torch.__version__,
        "neuron_compile": __version__,
        "neuron_compile_source": source_fingerprint(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
    if target == "neuron":
        versions["neuronx-cc"] = _neuronx_cc_version(generation)
        # with it, kernel sites are kernels it compiled; without it, StableHLO references (kernel_routing.py)
        versions["nki"] = nki_version()
    else:  # XLA's flags (fusion emitters, fast math) shape the CPU executable as a compiler version does
        versions["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return versions


def environment(opts: Options) -> dict[str, Any]:
    """What shapes every artifact besides its graph and inputs: options, target, versions, the user tag.
    Also in the key of our entries in AOTAutograd's cache (``aot_cache.fingerprint``)."""
    options = opts.cache_relevant()
    # torch-neuronx's wrapper flags (--cache_dir, --log_level, ...) do not change what neuronx-cc makes
    options["neuron_cc_flags"] = list(neuronx_cc.wrapper_flags(tuple(opts.neuron_cc_flags)).compiler)
    return {
        "format": KEY_FORMAT,
        "options": options,
        "target": opts.target,
        "versions": package_versions(opts.target, opts.generation),
        "tag": str(torch.compiler.config.cache_key_tag),
    }


def cache_key(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options) -> CacheKey:
    """THE key of a compiled graph. Raises ``NotCacheable`` when the graph cannot be keyed faithfully."""
    graph = canonical_graph(gm)
    signature = input_signature(example_inputs)
    summary = {
        **environment(opts),
        "graph": hashlib.sha256(repr(graph).encode()).hexdigest()[:40],
        "inputs": signature,
        # a forward's outputs saved for the backward may be returned channels-last (lowering/layout.py)
        "saved_for_backward_from": getattr(gm, "meta", {}).get(SAVED_FOR_BACKWARD_FROM),
        "num_nodes": len(graph),
    }
    return CacheKey(key_digest(summary), summary)


def key_digest(summary: dict[str, Any]) -> str:
    """The key of a summary (``cache_key``'s): everything in it, the graph by its digest."""
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:40]


#: What a key part is called in a "why did this miss" line: (prefix of its path in the summary, name).
_PART_NAMES = (
    ("graph", "graph"), ("num_nodes", "graph"), ("saved_for_backward_from", "graph"),
    ("inputs", "input shapes/dtypes"), ("target", "target"), ("options.target", "target"),
    ("options.generation", "generation"), ("options.neuron_cc_flags", "flags"), ("versions", "versions"),
    ("options", "options"), ("tag", "cache_key_tag"), ("format", "key format"),
)  # fmt: skip


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, list) and path == "inputs":
        out[f"{path}.count"] = len(value)
        for i, v in enumerate(value):
            out[f"{path}[{i}]"] = v
    else:
        out[path] = value


def part_name(path: str) -> str:
    """The key part a summary path belongs to: "graph", "input shapes/dtypes", "flags", "versions"..."""
    for prefix, name in _PART_NAMES:
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            return name
    return "other"


def key_differences(wanted: dict[str, Any], found: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(summary path, wanted value, found value) of every leaf where two key summaries differ, e.g.
    ``("options.opt_level", 3, 2)``, ``("inputs[0]", "float32[8, 4] ...", "float32[4, 4] ...")``; a value
    absent on one side is None. Empty: the same key."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten(wanted, "", a)
    _flatten(found, "", b)
    # options.target repeats the target: named once
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "options.target"]
