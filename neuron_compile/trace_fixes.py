"""What torch does to an op before our decomposition table is consulted, corrected where it is wrong for us.

Installed by ``install(neuron_backend)`` once, when backend.py is imported, i.e. when
``torch.compile(backend="neuron")`` resolves the backend, before Dynamo traces a frame:

1. torch's Autograd-level decompositions that give wrong values (``decompositions.AUTOGRAD_KERNEL_FIXES``:
   multilabel_margin_loss with -1-padded targets, both margin losses' 1-d shapes and tie gradients) are
   replaced; Dynamo's fake propagation runs them too, so they must be in place before it. (The
   decomposition table installs them as well, at the first compile, for graphs traced without the backend.)
2. Dynamo's own splits of a few ops with a scalar coefficient are undone for neuron compiles. Before any
   backend sees a graph, Dynamo rewrites (torch/_dynamo/variables) ``torch.addcdiv(a, t1, t2, value=v)``
   into div, mul and add; ``Tensor.addcmul_(t1, t2, value=v)`` into ``prims.fma(t1 * t2, v, self)`` and
   ``Tensor.addcdiv_`` into ``prims.fma(t1 / t2, v, self)``; ``torch._foreach_lerp_(self, end, w)`` with a
   scalar weight into ``_foreach_sub`` and ``_foreach_addcmul_``, with ``w`` (or ``1 - w``) rounded to the
   tensors' dtype. The splits exist so that a *tensor* coefficient needs no ``.item()`` (a graph break),
   and so that Inductor's code matches CUDA eager's fused multiply-adds. In bfloat16 and float16 each part
   rounds to the dtype, where eager's CPU kernel computes in float32 and rounds once: ``addcdiv`` on
   OpInfo's own bfloat16 sample is 2.2 ulp from the exact value where eager is 0.2 ulp, and
   ``_foreach_lerp_`` differs from eager on 10% of bfloat16 elements with ``w = 0.1`` (Adam's ``foreach``
   first moment), on half of them with ``w = 0.9``.

   For a neuron compile whose coefficient is a Python number, the call is kept whole: AOTAutograd gets the
   aten op (``addcdiv``, ``addcmul``, ``_foreach_lerp``), computed in opmath and rounded once
   (lowering/pointwise.py; decompositions.py). A tensor or symbolic coefficient keeps Dynamo's form (the
   graph break it avoids would cost more), and other backends' compiles are left as Dynamo makes them.
3. ``flex_attention`` refuses gradients for CPU tensors in its Python checks ("FlexAttention does not support
   backward on CPU"), which Dynamo traces: torch has no CPU kernel for its backward. The neuron backend lowers
   the backward (lowering/flex_attention.py) and is handed CPU tensors, so for neuron compiles that one check
   is skipped; eager and other backends' compiles still make it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

#: Set on a backend callable that compiles with the neuron backend (the backend itself, or a wrapper that
#: calls it, such as evaluate's collecting backend): its compiles get the ops whole.
NEURON_BACKEND_MARK = "_neuron_compile_backend"
_WRAPPED = "_neuron_compile_unsplit"


def _links(fn: Any) -> Any:
    """``fn`` and the callables it wraps: Dynamo's debug wrapper, torch.compile's wrapper, partials,
    ``functools.wraps`` wrappers (a few levels; the chain is short)."""
    for _ in range(8):
        if fn is None:
            return
        yield fn
        fn = next(
            (getattr(fn, name) for name in ("_torchdynamo_orig_backend", "compiler_fn", "func", "__wrapped__")
             if getattr(fn, name, None) is not None),
            None,
        )  # fmt: skip


def is_neuron_backend(fn: Any) -> bool:
    """Whether the backend callable ``fn`` (or one it wraps) compiles with the neuron backend."""
    return any(getattr(link, NEURON_BACKEND_MARK, False) for link in _links(fn))


def compiles_for_neuron(tx: Any) -> bool:
    """Whether the frame ``tx`` traces is compiled by the neuron backend."""
    return is_neuron_backend(getattr(tx.output, "compiler_fn", None))


def _is_number(var: Any) -> bool:
    """A Dynamo variable holding a Python number (not a tensor, not a symbolic int/float)."""
    if var is None or not var.is_python_constant():
        return False
    value = var.as_python_constant()
    return isinstance(value, (bool, int, float))


def _unless_neuron_number(original: Callable[..., Any], coefficient: Callable[..., Any]) -> Callable[..., Any]:
    """A Dynamo handler that returns None (Dynamo then records the call as it is) when the compile is a neuron
    one and ``coefficient(*args, **kwargs)`` is a Python number; otherwise ``original``'s rewrite."""

    @functools.wraps(original)
    def handler(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_number(coefficient(*args, **kwargs)) and compiles_for_neuron(tx):
            return None
        return original(self, tx, *args, **kwargs)

    setattr(handler, _WRAPPED, True)
    return handler


def _value_kwarg(*args: Any, **kwargs: Any) -> Any:
    return kwargs.get("value")


def _lerp_weight(*args: Any, **kwargs: Any) -> Any:
    # Dynamo's polyfill takes (self, end, weight) positionally with no keywords, a scalar weight only.
    return args[2] if len(args) == 3 and not kwargs else None


@torch._dynamo.assume_constant_result
def _tracing_for_neuron() -> bool:
    """Whether Dynamo is tracing a frame for the neuron backend (a constant of the trace)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return tx is not None and compiles_for_neuron(tx)


def _flex_backward_allowed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``flex_attention``'s device check without its refusal of CPU gradients, in neuron compiles."""

    @functools.wraps(original)
    def validate_device(query: Any, key: Any, value: Any) -> Any:
        if torch.compiler.is_dynamo_compiling() and query.device.type == "cpu" and _tracing_for_neuron():
            return None
        return original(query, key, value)

    setattr(validate_device, _WRAPPED, True)
    return validate_device


def install(neuron_backend: Callable[..., Any]) -> None:
    """Fix torch's Autograd kernels, mark ``neuron_backend`` and wrap Dynamo's handlers of the calls above and
    flex_attention's device check (idempotent)."""
    import torch.nn.attention.flex_attention as flex
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    from .decompositions import fix_autograd_kernels

    fix_autograd_kernels()
    setattr(neuron_backend, NEURON_BACKEND_MARK, True)
    handlers = TorchInGraphFunctionVariable._get_handlers()  # cached: the dict Dynamo looks handlers up in
    for fn, coefficient in ((torch.addcdiv, _value_kwarg), (torch._foreach_lerp_, _lerp_weight)):
        if fn in handlers and not getattr(handlers[fn], _WRAPPED, False):
            handlers[fn] = _unless_neuron_number(handlers[fn], coefficient)
    for name in ("method_addcmul_", "method_addcdiv_"):
        method = getattr(TensorVariable, name, None)
        if method is not None and not getattr(method, _WRAPPED, False):
            setattr(TensorVariable, name, _unless_neuron_number(method, _value_kwarg))
    check = getattr(flex, "_validate_device", None)
    if check is not None and not getattr(check, _WRAPPED, False):
        flex._validate_device = _flex_backward_allowed(check)
