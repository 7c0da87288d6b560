"""Automatic mixed precision on the ``neuron`` device: ``torch.autocast("neuron")`` with CUDA's policy, and
``torch.amp.GradScaler("neuron")``.

**Autocast.** torch's C++ registers autocast kernels for CUDA, CPU, XPU, MPS, MTIA and MAIA, and nothing for
PrivateUse1: not even the fallthrough, so any op under ``torch.autocast("neuron")`` failed ("Could not run
'aten::linear' with arguments from the 'Autocastneuron' backend"). :func:`register` puts on the
``AutocastPrivateUse1`` key the fallthrough for every op and CUDA's policy for the ops CUDA lists (one table,
:data:`POLICY`, copied from ``AT_FORALL_LOWER_PRECISION_FP`` / ``AT_FORALL_FP32`` / ``AT_FORALL_FP32_SET_OPT_DTYPE``
/ ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` / ``AT_FORALL_PROMOTE`` of ``ATen/autocast_mode.h``, torch
2.13, and CUDA's banned ``binary_cross_entropy``): matmuls, linear and convolutions in the autocast dtype;
softmax, log_softmax, layer_norm, the losses, exp/log/pow... in float32; addcmul, cat-like promoting ops in
the widest input type. The kernels run above autograd (as CUDA's), so the casts are recorded and the inputs of
a lower-precision op are saved for backward in lower precision; under ``torch.compile(backend="neuron")``
AOTAutograd traces through them, so the compiled graph holds the same casts. One difference: CUDA caches the
lower-precision copy of a weight for the autocast region (``cache_enabled``); here each use casts it again
(the same values; one more cast per use in eager, none in a compiled graph, which dedupes them).

**GradScaler.** torch's scaler computes ``inv_scale = scale.double().reciprocal().float()`` (float64 because
"FP32 division can be imprecise for certain compile options"), then runs ``_amp_foreach_non_finite_check_and_unscale_``
and ``_amp_update_scale_``, which have CUDA and CPU kernels only. The device has no float64 arithmetic, and a
float32 reciprocal on Trainium's engines is not guaranteed correctly rounded, so the reciprocal must not be
computed on the device. What we do, exactly what the scaler's CPU path computes, never approximated:

* ``scale.double()`` **called by torch's GradScaler** (``torch/amp/grad_scaler.py`` or FSDP's
  ``sharded_grad_scaler.py``) on the 0-d scale returns the scale as a float64 **CPU** scalar (a 4-byte read),
  so the reciprocal is the CPU's float64 one; the scaler then copies ``inv_scale`` to the gradients' device
  itself (``_MultiDeviceReplicator``). Any other float64 request for a neuron tensor is refused, the message
  naming torch's caller when torch (not the user's code) asked. This is scoped to the scaler's own frames so
  that ``t.double()`` in user code keeps the device's refusal (a tensor that changed device would surprise).
  The scaler reads ``found_inf`` with ``.item()`` at every step anyway, so the extra read costs no new sync.
* ``_amp_foreach_non_finite_check_and_unscale_`` runs on the device as ONE graph over the gradient list
  (``g * inv_scale`` in float32 as CPU's and CUDA's kernels compute it, and ``found_inf`` set to 1 when any
  gradient has an inf or NaN); the gradients never leave the device.
* ``_amp_update_scale_`` (three scalars: scale, growth tracker, found_inf) runs torch's own CPU kernel on host
  copies (12 bytes down, 8 up), since its ``scale * growth_factor`` is computed in float64 by torch's kernels.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from ..stats import STATS

aten = torch.ops.aten

_AUTOCAST_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_NO_AUTOCAST = torch._C.DispatchKeySet(_AUTOCAST_KEY)

LOWER_PRECISION_FP = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
BANNED = "banned"

#: CUDA's autocast policy (ATen/autocast_mode.h and autocast_mode.cpp, torch 2.13): "op" or "op.overload" ->
#: policy. A missing op (an older or newer torch) is skipped at registration.
POLICY: dict[str, str] = {
    **dict.fromkeys(
        [
            "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
            "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
            "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
            "scaled_dot_product_attention",
        ],
        LOWER_PRECISION_FP,
    ),
    **dict.fromkeys(
        [
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
            "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
            "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
            "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
            "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
            "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
            "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
            "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
            "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
            "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
            "_upsample_bicubic2d_aa",
        ],
        FP32,
    ),
    **dict.fromkeys(
        [
            "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
            "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
        ],
        FP32_SET_OPT_DTYPE,
    ),
    **dict.fromkeys(["norm.Scalar", "norm.ScalarOpt_dim"], FP32_APPEND_DTYPE),
    **dict.fromkeys(
        ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
         "scatter_add"],
        PROMOTE,
    ),
    "binary_cross_entropy": BANNED,
}  # fmt: skip

#: fp32_append_dtype: the overload each redispatches to, with ``dtype=float32`` appended.
_APPEND_DTYPE_TARGET = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def _eligible(x: Any) -> bool:
    """A tensor autocast casts (``is_eligible`` of autocast_mode.h): floating point, on the device, not float64."""
    return (
        isinstance(x, torch.Tensor) and x.device.type == "neuron" and x.is_floating_point() and x.dtype != torch.float64
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _lower_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("neuron")


def _first_tensor_eligible(args: tuple) -> bool:
    return bool(args) and _eligible(args[0])


def _kernel(op: torch._ops.OpOverload, name: str, policy: str) -> Callable[..., Any]:
    if policy == BANNED:

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BANNED_MESSAGE)

        return banned

    if policy == FP32_APPEND_DTYPE:
        packet, overload = _APPEND_DTYPE_TARGET[name].split(".")
        target = getattr(getattr(aten, packet), overload)

    dtype_position = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            if policy == LOWER_PRECISION_FP:
                dtype = _lower_dtype()
                return op(*_cast(args, dtype), **_cast(kwargs, dtype))
            if policy == FP32:
                return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
            if policy == FP32_SET_OPT_DTYPE:
                if not _first_tensor_eligible(args):
                    return op(*args, **kwargs)
                if dtype_position is not None and dtype_position < len(args):
                    if args[dtype_position] is None:
                        args = (*args[:dtype_position], torch.float32, *args[dtype_position + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == FP32_APPEND_DTYPE:
                if not _first_tensor_eligible(args):
                    return op(*args, **kwargs)
                return target(*args, **kwargs, dtype=torch.float32)
            # PROMOTE: the widest floating type among the eligible inputs, starting from the autocast dtype
            widest = _lower_dtype()
            for t in _tensors(args) + _tensors(list(kwargs.values())):
                if _eligible(t) and t.dtype != widest:
                    widest = torch.promote_types(widest, t.dtype)
            return op(*_cast(args, widest), **_cast(kwargs, widest))

    return kernel


def _overload(name: str) -> torch._ops.OpOverload | None:
    packet_name, _, overload = name.partition(".")
    packet = getattr(aten, packet_name, None)
    if packet is None or (overload or "default") not in packet.overloads():
        return None
    return getattr(packet, overload or "default")


def register_autocast() -> list[Any]:
    """The fallthrough and CUDA's policy on ``AutocastPrivateUse1``; the libraries to keep alive."""
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    for name, policy in POLICY.items():
        op = _overload(name)
        if op is None:
            continue
        lib.impl(name, _kernel(op, name, policy), "AutocastPrivateUse1")
    return [everything, lib]


# -- GradScaler ------------------------------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: torch's files whose float64 copy of a neuron scalar is computed on the host (see the module's docstring).
_SCALER_FILES = (
    os.path.join(_TORCH_DIR, "amp", "grad_scaler.py"),
    os.path.join(_TORCH_DIR, "distributed", "fsdp", "sharded_grad_scaler.py"),
)


#: torch's files that only pass a call through to our kernel (the dispatcher's Python side, Dynamo's
#: ``disable`` wrapper around the device's kernels): not "who asked".
_PLUMBING = (
    os.path.join(_TORCH_DIR, "_ops.py"),
    os.path.join(_TORCH_DIR, "_dynamo") + os.sep,
    os.path.join(_TORCH_DIR, "utils", "_contextlib.py"),
)


def _torch_caller() -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame outside this package and torch's dispatch plumbing,
    when that frame is torch's own code (not the user's); else None."""
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(package) and not path.startswith(_PLUMBING):
            if path.startswith(_TORCH_DIR):
                return path, frame.f_lineno, frame.f_code.co_name
            return None
        frame = frame.f_back
    return None


def to_copy(
    self: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    non_blocking: bool = False,
    memory_format: Any = None,
) -> torch.Tensor:
    """``aten::_to_copy`` of a neuron tensor: torch's own kernel, except for a float64 copy that stays on the
    device (the device has none): the GradScaler's scale goes to the host (module docstring), anything else is
    refused with who asked."""
    from . import onegraph

    staying = self.device.type == "neuron" and (device is None or torch.device(device).type == "neuron")
    if dtype == torch.float64 and staying and not onegraph.printing():  # the printer's own float64 is allowed
        caller = _torch_caller()
        if caller is not None and caller[0] in _SCALER_FILES and self.dim() == 0 and self.dtype == torch.float32:
            STATS.record_transfer(device_to_host=4)
            return self.cpu().to(torch.float64)
        _refuse_float64(self, caller)
    return aten._to_copy.default.redispatch(
        _COMPOSITE,
        self,
        dtype=dtype,
        layout=layout,
        device=device,
        pin_memory=pin_memory,
        non_blocking=non_blocking,
        memory_format=memory_format,
    )


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _refuse_float64(t: torch.Tensor, caller: tuple[str, int, str] | None) -> None:
    if caller is None:
        raise TypeError(
            f"Cannot make a float64 copy of a {t.dtype} tensor on the neuron device: Trainium has no float64 "
            "arithmetic. Keep it in float32, or move it to CPU first (.cpu().double()), or compile the code that "
            "uses it (torch.compile computes float64 as float32 with a warning)."
        )
    path, line, function = caller
    raise TypeError(
        f"neuron device: torch's own code ({os.path.relpath(path, os.path.dirname(_TORCH_DIR))}:{line}, in "
        f"{function}) asked for a float64 copy of a {t.dtype} tensor of shape {list(t.shape)} on the neuron device, "
        "which has no float64 arithmetic: not something your code did. The device does not support this torch "
        "feature yet; report it with `neuron-compile doctor --bundle`, and run that part on CPU meanwhile."
    )


def _unscale_graph(n: int) -> Callable[..., Any]:
    def fn(found_inf: torch.Tensor, inv_scale: torch.Tensor, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bad = torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in grads]).any()
        found = torch.where(bad, torch.ones_like(found_inf), found_inf)
        scaled = [(g.float() * inv_scale).to(g.dtype) for g in grads]
        return (found, *scaled)

    return fn


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` on the device: one graph over the list."""
    from . import context, onegraph

    if not grads:
        return
    for g in grads:
        if g.device != found_inf.device or g.device != inv_scale.device:
            raise RuntimeError(
                "_amp_foreach_non_finite_check_and_unscale_: grads, found_inf and inv_scale must be on the same "
                f"device (got {g.device}, {found_inf.device}, {inv_scale.device})"
            )
    tensors = [found_inf, inv_scale, *grads]
    key = (context.device().target.name, "amp_unscale", tuple((tuple(t.shape), t.dtype) for t in tensors))
    entry = onegraph.GRAPHS.get(key)
    if entry is None:
        with onegraph.GRAPHS_LOCK:
            entry = onegraph.GRAPHS.get(key)
            if entry is None:
                examples = [onegraph.example(t) for t in tensors]
                gm = onegraph.trace(_unscale_graph(len(grads)), examples)
                graph = onegraph.compile_one(gm, "amp_foreach_non_finite_check_and_unscale", context.device().opts)
                entry = onegraph.GRAPHS.setdefault(key, onegraph.OpGraph(graph, len(tensors) - 1))
                STATS.eager_ops_compiled += 1
    STATS.eager_ops_run += 1
    found, *scaled = entry.graph(tensors)
    context.set_values(found_inf, found)
    for g, value in zip(grads, scaled):
        context.set_values(g, value)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> torch.Tensor:
    """``torch._amp_update_scale_`` on the device: torch's CPU kernel on host copies of the three scalars."""
    from . import context

    host = [context.download(t).clone() for t in (scale, growth_tracker, found_inf)]
    torch._amp_update_scale_(host[0], host[1], host[2], growth_factor, backoff_factor, growth_interval)
    index = scale.device.index or 0
    context.set_values(scale, context.upload(host[0], index))
    context.set_values(growth_tracker, context.upload(host[1], index))
    return scale


def register() -> list[Any]:
    """Autocast's kernels and the GradScaler's; the libraries to keep alive."""
    from . import context

    serialized = getattr(context, "serialized", lambda fn: fn)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_to_copy", serialized(to_copy), "PrivateUse1")
    lib.impl("_amp_foreach_non_finite_check_and_unscale_", serialized(non_finite_check_and_unscale_), "PrivateUse1")
    lib.impl("_amp_update_scale_", serialized(update_scale_), "PrivateUse1")
    return [*register_autocast(), lib]
