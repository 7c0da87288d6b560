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
- under ``torch.compile(backend="neuron")`` it is one graph node, lowered (``lowering/kernel_routing.py``) to a
  host callback into the emulator on the CPU target; the neuron target refuses it (naming the op and its
  source line): it has no compiled form there yet, see ``kernel_routing.user_kernel_on_neuron_reason``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

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
    the kernels write in place (they must be written, e.g. a kernel that DMAs into its HBM argument).
    Usable as ``@nki_op("ns::name")`` or ``nki_op("ns::name", fn)``.
    """

    def wrap(func: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args, schema=schema)(func)
        op.register_fake(func)  # fake tensors make its kernels run in shape-only mode
        USER_KERNELS[op._opoverload] = func
        return op

    return wrap(fn) if fn is not None else wrap


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
