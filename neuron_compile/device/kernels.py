"""The ``neuron`` device's kernels on PrivateUse1: memory (``empty``, ``resize_``, ``set_``), copies across
devices, ``.item()``, the ``_foreach_*`` ops (one graph for the whole list), and one boxed fallback for every
other op (a view, or a one-op graph: ``eager.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import NeuronUnsupportedOpError
from . import context, eager
from . import storage as mem

aten = torch.ops.aten


def empty_memory_format(
    size: list[int], dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    stride = None
    if memory_format is torch.channels_last and len(size) == 4:
        stride = list(torch._prims_common.make_channels_last_strides_for(size))
    elif memory_format is torch.channels_last_3d and len(size) == 5:
        stride = list(torch._prims_common.make_channels_last_strides_for(size))
    return context.empty(list(size), stride, dtype, context.index_of(device))


def empty_strided(size: list[int], stride: list[int], dtype=None, layout=None, device=None, pin_memory=None):
    return context.empty(list(size), list(stride), dtype or torch.get_default_dtype(), context.index_of(device))


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` where either is on the device (PyTorch routes such copies here)."""
    if dst.device.type == "neuron" and src.device.type != "neuron":
        value = src.to(dst.dtype).expand(dst.shape).contiguous()
        context.set_values(dst, context.upload(value, dst.device.index or 0))
    elif src.device.type == "neuron" and dst.device.type != "neuron":
        dst.copy_(context.download(src))
    elif src.dtype == dst.dtype and src.shape == dst.shape:
        context.set_values(dst, src)
    else:
        eager.run_or_fall_back(aten.copy_.default, (dst, src), {})
    return dst


def copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.numel() == 0 or tuple(dst.shape) != tuple(src.shape):
        resize_(dst, list(src.shape))
    return copy_from(src, dst)


def local_scalar_dense(t: torch.Tensor) -> Any:
    return context.download(t).item()


def resize_(t: torch.Tensor, size: list[int], memory_format=None) -> torch.Tensor:
    """New geometry; a larger storage keeps its old bytes first (as torch's ``resize_``)."""
    size = list(size)
    stride = list(torch._prims_common.make_contiguous_strides_for(size))
    needed = (t.storage_offset() + _numel(size)) * t.element_size()
    st = mem.device_storage(t)
    if needed > st.nbytes:
        old = t.detach()
        grown = context.empty([needed // t.element_size()], None, t.dtype, t.device.index or 0)
        if st.nbytes and st.buffer is not None:
            keep = st.nbytes // t.element_size()
            context.set_values(grown[:keep], mem.make_tensor((keep,), (1,), 0, t.dtype, old.untyped_storage()))
        storage = grown.untyped_storage()
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(mem._META, t, storage, 0, [0], [1])
    torch.ops.aten.as_strided_.default.redispatch(mem._NON_FUNCTIONAL, t, size, stride, t.storage_offset())
    return t


def _numel(size: list[int]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def set_storage(t: torch.Tensor, source: Any, storage_offset: int = 0, size=None, stride=None) -> torch.Tensor:
    storage = source.untyped_storage() if isinstance(source, torch.Tensor) else source
    if isinstance(source, torch.Tensor) and size is None:
        size, stride, storage_offset = list(source.shape), list(source.stride()), source.storage_offset()
    if size is None:
        size, stride = [storage.nbytes() // t.element_size()], [1]
    if stride is None:
        stride = list(torch._prims_common.make_contiguous_strides_for(size))
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(mem._META, t, storage, 0, [0], [1])
    torch.ops.aten.as_strided_.default.redispatch(mem._NON_FUNCTIONAL, t, list(size), list(stride), storage_offset)
    return t


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return bool(torch.eq(a, b).all().item())


def native_batch_norm(
    input: torch.Tensor, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
) -> Any:
    """``native_batch_norm`` writes its running statistics without saying so in its schema (no ``Tensor(a!)``),
    so neither a one-op graph nor the host fallback would know to write them back: its twin
    ``_native_batch_norm_legit``, whose schema names them as written, runs instead."""
    if running_mean is None and running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return aten._native_batch_norm_legit.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """Scaled dot-product attention in eager takes torch's math path (one op at a time) on the device."""
    return int(torch.nn.attention.SDPBackend.MATH)


def fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    if eager.is_view_op(op):
        return eager.run_view(op, args, kwargs)
    return eager.run_or_fall_back(op, args, kwargs)


_PER_TENSOR_LOOP = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _foreach_kernel(op: torch._ops.OpOverload) -> Any:
    """``_foreach_*`` ops run as ONE graph over the whole list (torch's kernel for a backend without fused ones
    loops over the tensors, which would make a graph and an execution per tensor shape: an optimizer step
    would compile ops x parameter shapes). One the device cannot compile as a whole runs torch's loop."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(x, torch.Tensor) and x.device.type == "neuron" for x in flat):
            run_op, run_args = _scalars_as_numbers(op, args)
            try:
                return eager.run(run_op, run_args, kwargs)
            except NeuronUnsupportedOpError:
                pass
        return op.redispatch(_PER_TENSOR_LOOP, *args, **kwargs)

    return kernel


def _scalars_as_numbers(op: torch._ops.OpOverload, args: tuple) -> tuple[torch._ops.OpOverload, tuple]:
    """``_foreach_addcdiv_.Tensor`` and friends take their per-tensor scalars as a CPU tensor, which torch's
    own loop turns into numbers: so do we (the ``ScalarList`` overload), or the graph would mix devices."""
    for i, arg in enumerate(op._schema.arguments[: len(args)]):
        value = args[i]
        if arg.name == "scalars" and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            packet = getattr(aten, op._schema.name.removeprefix("aten::"))
            if "ScalarList" in packet.overloads():
                return packet.ScalarList, (*args[:i], value.tolist(), *args[i + 1 :])
    return op, args


def _foreach_ops() -> list[tuple[str, torch._ops.OpOverload]]:
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::_foreach_"):
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"):
            continue  # nothing to replace (and no loop to fall back on)
        packet, _, overload = name.removeprefix("aten::").partition(".")
        ops.append((name.removeprefix("aten::"), getattr(getattr(aten, packet), overload or "default")))
    return ops


_KERNELS = {
    "empty.memory_format": empty_memory_format,
    "empty_strided": empty_strided,
    "_copy_from": copy_from,
    "_copy_from_and_resize": copy_from_and_resize,
    "_local_scalar_dense": local_scalar_dense,
    "resize_": resize_,
    "set_.source_Storage": lambda t, source: set_storage(t, source),
    "set_.source_Storage_storage_offset": set_storage,
    "set_.source_Tensor": lambda t, source: set_storage(t, source),
    "equal": equal,
    "_fused_sdp_choice": fused_sdp_choice,
    "native_batch_norm": native_batch_norm,
}


def _no_tag(obj: Any) -> None:
    return None  # torch's own privateuse1 tagger names the location of a neuron storage when saving


def _deserialize(obj: Any, location: str) -> Any:
    """``torch.load(map_location="neuron")``: a loaded CPU storage uploaded to the device (torch's own path
    for PrivateUse1 builds an empty storage through a C++ allocator, which a device written in Python has not)."""
    if not (location == "neuron" or location.startswith("neuron:")):
        return None
    index = torch.device(location).index or 0
    host = torch.empty(0, dtype=torch.uint8).set_(obj.untyped() if hasattr(obj, "untyped") else obj)
    return context.upload(host, index).untyped_storage()


#: Composite ops whose CPU/CUDA route ends in an "overrideable" op for other backends
#: (``convolution_overrideable``), which nothing lowers: on the device they run whole, as one graph of the op.
_WHOLE = ("convolution", "convolution_backward", "native_group_norm", "native_group_norm_backward")


def _whole(name: str) -> Any:
    packet, _, overload = name.partition(".")
    op = getattr(getattr(aten, packet), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return eager.run_or_fall_back(op, args, kwargs)

    return kernel


def register() -> list[Any]:
    """Register the kernels and the fallback; the libraries to keep alive."""
    torch.serialization.register_package(19, _no_tag, _deserialize)
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in _KERNELS.items():
        lib.impl(name, context.serialized(fn), "PrivateUse1")
    for name in _WHOLE:
        lib.impl(name, context.serialized(_whole(name)), "PrivateUse1")
    for name, op in _foreach_ops():
        lib.impl(name, context.serialized(_foreach_kernel(op)), "PrivateUse1")
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(context.serialized(fallback), dispatch_key="PrivateUse1", with_keyset=False)
    return [lib, everything]
