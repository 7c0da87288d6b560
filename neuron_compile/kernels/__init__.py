"""Built-in NKI kernels, their StableHLO references, and the NKI emulator they run on here.

``KERNELS`` maps a kernel name to a :class:`KernelSpec`: the NKI kernel, its reference (jax.lax, the
StableHLO the compiler emits at a kernel site on the CPU target, and on the neuron target without the real
nki; same signature, same outputs) and a predicate saying which shapes/dtypes the kernel supports. Functions are resolved lazily, so importing
this package imports neither jax nor the kernels. The routing table (elsewhere) imports ``KERNELS``.

Kernel modules: :mod:`.matmul`, :mod:`.softmax`, :mod:`.norms`, :mod:`.attention`, :mod:`.swiglu`;
:mod:`.cost` is the cost model; :mod:`.emulator` the NKI emulator (public face: ``neuron_compile.nki``);
:mod:`.nki_compiled` the real nki's compile of a kernel, which the neuron target's kernel sites carry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["KERNELS", "KernelSpec"]


@dataclass(frozen=True)
class KernelSpec:
    """One built-in kernel: ``kernel(*args)`` (NKI), ``reference(*args)`` (jax), ``supports(*args)``.

    All three take the same arguments: array-likes (anything with ``.shape``/``.dtype`` for
    ``supports``) followed by the kernel's constants (eps, causal, scale...). ``outputs`` names the
    returned arrays in order.
    """

    name: str
    module: str
    kernel_name: str
    reference_name: str
    supports_name: str
    outputs: tuple[str, ...]
    doc: str

    def _get(self, attr: str) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), attr)

    @property
    def kernel(self) -> Any:
        """The ``@nki.jit`` kernel (run it with ``nki.simulate(spec.kernel)(*arrays)``)."""
        return self._get(self.kernel_name)

    @property
    def reference(self) -> Callable[..., Any]:
        """The jax.lax reference with the kernel's signature."""
        return self._get(self.reference_name)

    @property
    def supports(self) -> Callable[..., bool]:
        """Predicate on the kernel's arguments (shapes/dtypes): True when the kernel handles them."""
        return self._get(self.supports_name)

    def fits(self, *args: Any) -> bool:
        """``supports(*args)``, where a predicate that cannot judge the arguments means "not supported"."""
        try:
            return bool(self.supports(*args))
        except Exception:
            return False


def _spec(name: str, module: str, outputs: tuple[str, ...], doc: str) -> KernelSpec:
    return KernelSpec(name, module, f"{name}_kernel", f"{name}_reference", f"{name}_supports", outputs, doc)


KERNELS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        _spec("matmul", "matmul", ("out",), "a[M,K] @ b[K,N], fp32 accumulation"),
        _spec("softmax", "softmax", ("out",), "softmax over the last dim of x[R,C]"),
        _spec("softmax_bwd", "softmax", ("dx",), "softmax backward from y and dy"),
        _spec("rms_norm", "norms", ("out",), "rms_norm(x[R,H], w[H], eps)"),
        _spec("rms_norm_bwd", "norms", ("dx", "dw"), "rms_norm backward (dy, x, w, eps)"),
        _spec("layer_norm", "norms", ("out",), "layer_norm(x[R,H], w[H], b[H], eps)"),
        _spec("layer_norm_bwd", "norms", ("dx", "dw", "db"), "layer_norm backward (dy, x, w, eps)"),
        _spec("flash_attention_fwd", "attention", ("o", "lse"), "attention(q,k,v[B,H,S,D], causal, scale)"),
        _spec("flash_attention_bwd", "attention", ("dq", "dk", "dv"), "attention backward from o and lse"),
        _spec("swiglu", "swiglu", ("out",), "silu(gate) * up"),
    )
}
