"""User NKI kernels as torch custom ops: ``nki_op``, as TorchNeuron users write them.

```python
@neuron_compile.nki_op("mylib::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return add_kernel(x, y, alpha)          # an @nki.jit kernel called with torch tensors
```

The result is a ``torch.library.custom_op``:
- eager (CPU tensors): the function runs; its ``@nki.jit`` kernels run in the NKI emulator;
- fake tensors (torch.compile tracing): the same function runs with its kernels in the emulator's
  shape-only mode, which infers output shapes/dtypes and checks the hardware rules without data
  (override with ``op.register_fake``);
- ``op.register_autograd(backward, setup_context=...)`` gives it a backward, as for any custom op;
- a kernel that writes an argument of the op which ``mutates_args`` does not name is refused
  (``NkiUndeclaredMutationError``, in eager, while tracing and in compiled graphs alike): eager would change
  the caller's tensor and a compiled graph would not. The emulator reports the HBM arguments each kernel run
  wrote (``watch_arg_writes``), so this needs the emulator (with the real ``nki`` nothing is checked);
- under ``torch.compile(backend="neuron")`` it is one graph node, lowered (``lowering/kernel_routing.py``) to a
  host callback into the emulator on the CPU target; the neuron target refuses it (naming the op and its
  source line): it has no compiled form there yet, see ``kernel_routing.user_kernel_on_neuron_reason``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

import numpy as np
import torch

#: The custom op's overload -> the user's Python function (what the host callback runs).
USER_KERNELS: dict[Any, Callable[..., Any]] = {}


def nki_op(
    name: str,
    fn: Callable[..., Any] | None = None,
    *,
    mutates_args: Iterable[str] | str = (),
    schema: str | None = None,
) -> Any:
    """Make a torch custom op ``name`` ("namespace::op") of ``fn``, whose body calls ``@nki.jit`` kernels.

    ``fn`` needs type annotations (torch.library.custom_op's rule). ``mutates_args`` names the arguments
    the kernels write in place (they must be written, e.g. a kernel that DMAs into its HBM argument); a
    kernel writing an argument not named there raises ``NkiUndeclaredMutationError`` naming it
    (``mutates_args="unknown"`` turns the check off). Usable as ``@nki_op("ns::name")`` or
    ``nki_op("ns::name", fn)``.
    """

    def wrap(func: Callable[..., Any]) -> Any:
        if mutates_args == "unknown":
            op = torch.library.custom_op(name, mutates_args=mutates_args, schema=schema)(func)
            impl = func
        else:
            declared = (mutates_args,) if isinstance(mutates_args, str) else tuple(mutates_args)
            op_schema = schema or torch.library.infer_schema(func, mutates_args=declared)
            impl = _refusing_undeclared_writes(name, func, declared)
            op = torch.library.custom_op(name, impl, mutates_args=declared, schema=op_schema)
        op.register_fake(impl)  # fake tensors make its kernels run in shape-only mode
        USER_KERNELS[op._opoverload] = impl
        return op

    return wrap(fn) if fn is not None else wrap


def _refusing_undeclared_writes(name: str, func: Callable[..., Any], declared: tuple[str, ...]) -> Callable[..., Any]:
    """``func``, raising after it when one of its kernels wrote an argument of the op not in ``declared``."""

    @functools.wraps(func)
    def impl(*args: Any, **kwargs: Any) -> Any:
        from .emulator import watch_arg_writes

        with watch_arg_writes() as writes:
            out = func(*args, **kwargs)
        if writes:
            _check_writes(name, func, declared, args, kwargs, writes)
        return out

    return impl


def _check_writes(
    name: str, func: Callable[..., Any], declared: tuple[str, ...], args: tuple, kwargs: dict, writes: list
) -> None:
    from .emulator import NkiUndeclaredMutationError

    bound = inspect.signature(func).bind(*args, **kwargs).arguments
    for write in writes:
        for arg, value in bound.items():
            if arg in declared:
                continue
            tensors = value if isinstance(value, (list, tuple)) else (value,)
            if not any(isinstance(t, torch.Tensor) and _same_storage(write.source, t) for t in tensors):
                continue
            fix = (*declared, arg)
            raise NkiUndeclaredMutationError(
                f"nki_op {name}: kernel {write.kernel} wrote its HBM argument '{write.param}', which is the op's "
                f"argument '{arg}', but the op declares mutates_args={declared!r}: eager mode would change the "
                "caller's tensor and a compiled graph would not (in eager mode it has been written already). "
                f"Declare the write, nki_op({name!r}, mutates_args={fix!r}), or have the kernel write a new "
                "nl.shared_hbm tensor and return it"
            )


def _same_storage(source: Any, t: torch.Tensor) -> bool:
    """Whether what a kernel was called with (a torch tensor, maybe a view, or a NumPy array) is ``t``'s
    memory; fake tensors compare by storage too."""
    if source is t:
        return True
    if isinstance(source, torch.Tensor):
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            return StorageWeakRef(source.untyped_storage()) == StorageWeakRef(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, some subclasses)
            return False
    if isinstance(source, np.ndarray) and t.device.type == "cpu" and t.layout == torch.strided:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return False
        from .emulator import torch_to_numpy

        return bool(np.shares_memory(source, torch_to_numpy(t)))
    return False


def user_kernel(op: Any) -> Callable[..., Any] | None:
    """The Python function behind a node target made by ``nki_op`` (None for any other op)."""
    return USER_KERNELS.get(op)


def has_user_kernels(gm: torch.fx.GraphModule) -> bool:
    """Whether an aten graph calls an ``nki_op`` kernel (directly or through auto_functionalized)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in USER_KERNELS or (node.args and node.args[0] in USER_KERNELS):
            return True
    return False
