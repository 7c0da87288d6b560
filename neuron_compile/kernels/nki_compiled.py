"""An NKI kernel compiled by the real ``nki`` package, in the form the neuron target's kernel sites carry it.

TorchNeuron, JAX and NKIPy put an NKI kernel into an XLA graph as ``custom_call @AwsNeuronCustomNativeKernel``
whose ``backend_config`` the nki compiler produces for the call's shapes, dtypes and constants: base64 JSON
naming the compiled kernel's file (``klir_binary.binary``), its input and output names, the platform target,
the LNC grid and ``mac_count``. neuronx-cc takes that file into the NEFF and fails with NCC_EVRF059 when it is
missing, so the file must outlive the graph's neuronx-cc compile (here: until the process exits).

NEVER RUN HERE: the real ``nki`` is not installable on this project's machines, so ``compiled_kernel_config``
has been read against its sources, not executed. Sources:

- the nki package itself (NKI >= 0.6), as copied into public repositories (no AWS repository publishes it):
  ``nki/framework/compiled.py`` ``CompileKernel``, the kernel "configured for compilation": its
  ``compile(*args, **kwargs) -> (FrameworkConfig, cache_key)`` ("Frameworks call this to get the compiled config
  for embedding in their computation graph") builds the production ``CompileOptions`` in ``_compile_opts()``
  (target, lnc, address rotation, barrier check from the kernel, and ``disable_backend_optimizations()`` unless
  the experimental MLIR pipeline is asked for). A bare ``CompileOptions`` handed to ``compile_kernel_to_nir``
  (what this module did before) keeps NKI's experimental backend optimizations on; ``FrameworkConfig``
  ("Public API": ``backend_config_b64``, ``output_specs``, ``operand_output_aliases``, ``has_collectives``);
- aws-neuron/nkipy ``nkipy/src/nkipy/core/nki_op.py`` (``_NKIPyCompileKernel``, ``_beta3_compile_and_get_config``):
  AWS's own integration, which replaced ``compile_kernel_to_nir`` with a bare ``CompileOptions`` by a
  ``CompileKernel`` for exactly that reason ("a bare CompileOptions silently inherits NKI's experimental
  defaults instead of the production ones"), carrying the ``@nki.jit`` kernel's own fields (lnc, schedule,
  address rotation...) over, ``lnc`` 1 when the kernel sets none, the platform target, artifacts in a directory
  that lives as long as the process; tensor arguments bound to the kernel's parameter names as empty NumPy
  arrays of their shape and dtype, constants as Python values; the custom call's operands are the tensor
  arguments in parameter order (nki handles the constants) and its results ``output_specs``. vllm-neuron's
  TorchNeuron integration (``libtorch_neuronx_lite/nki/nki_compile.py``) compiles the same way
  (``CompileKernel(func, lnc, target)`` and its ``_compile_opts()``);
- aws-neuron/aws-neuron-sdk ``general/nki/api/nki/__init__.py`` ``FrameworkKernel``: the contract of the custom
  call (``custom_call_target`` "should always be AwsNeuronCustomNativeKernel"; its HLO example has
  ``api_version=API_VERSION_UNSPECIFIED``, and "The field `api_version` is optional"). The kernel site's call is
  emitted with that API version (``lowering/device_calls.py``, as torch-xla writes Neuron's custom calls), not
  jax's default for a legacy custom call (API_VERSION_ORIGINAL).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np


def real_nki_in_use() -> bool:
    """Whether the kernels are the real ``nki``'s (``nki_api``, the one switch, decides), so that a neuron
    target kernel site can carry its compiled kernel."""
    from . import nki_api  # here, not at import: lowering a CPU-target graph never asks

    return not nki_api.EMULATED


@dataclass(frozen=True)
class CompiledKernelConfig:
    """What a kernel site's custom call needs from the compiled kernel."""

    #: base64 JSON (ASCII): the custom call's ``backend_config``.
    backend_config: str
    #: (shape, NumPy dtype name) of each result, in order: must equal the kernel's reference's results.
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    #: (operand index, result index) pairs the kernel writes in place.
    operand_output_aliases: tuple[tuple[int, int], ...]
    #: The kernel uses collectives (the custom call then needs ``has_collectives``).
    has_collectives: bool


def compiled_kernel_config(
    kernel: Any, arrays: tuple[Any, ...], consts: tuple[Any, ...], generation: str
) -> CompiledKernelConfig:
    """The real nki's compile of ``kernel`` (an ``@nki.jit`` kernel) for ``arrays`` (anything with ``.shape``
    and ``.dtype``: jax values at a kernel site) followed by ``consts`` (Python values), for ``generation``
    ("trn2", "trn3": the neuronx-cc target of the graph). Compiled once per process for equal arguments.

    NEVER RUN HERE (see the module docstring for the API it is written against).
    """
    signature = tuple((tuple(int(d) for d in a.shape), np.dtype(a.dtype)) for a in arrays)
    key = (kernel, signature, consts, generation)
    try:
        cached = _COMPILED.get(key)
    except TypeError:  # an unhashable kernel or constant: compiled for this site alone
        return _compile(kernel, signature, consts, generation)
    if cached is None:
        cached = _COMPILED[key] = _compile(kernel, signature, consts, generation)
    return cached


_COMPILED: dict[tuple[Any, ...], CompiledKernelConfig] = {}


def production_kernel(kernel: Any, generation: str, artifacts_dir: str) -> Any:
    """``kernel`` (an ``@nki.jit`` kernel) as nki's ``CompileKernel`` for ``generation``: the kernel's own settings
    carried over (lnc, schedule, address rotation, ...; lnc 1 when it sets none), so that nki builds its
    production compile options, as nkipy's and TorchNeuron's integrations do."""
    from nki.framework.compiled import CompileKernel

    accepted = {f.name for f in dataclasses.fields(CompileKernel)}
    fields = (
        {f.name: getattr(kernel, f.name) for f in dataclasses.fields(kernel) if f.name in accepted}
        if dataclasses.is_dataclass(kernel)
        else {}
    )
    func = fields.pop("func", None) or getattr(kernel, "func", kernel)
    if not fields.get("lnc"):
        fields["lnc"] = getattr(kernel, "lnc", None) or 1
    fields.update(target=generation, artifacts_dir=artifacts_dir)
    return CompileKernel(func, **fields)


def _compile(
    kernel: Any, signature: tuple[tuple[tuple[int, ...], np.dtype], ...], consts: tuple[Any, ...], generation: str
) -> CompiledKernelConfig:
    parameters = list(inspect.signature(getattr(kernel, "func", kernel)).parameters)
    values = [np.empty(shape, dtype) for shape, dtype in signature] + list(consts)
    if len(values) > len(parameters):
        raise TypeError(f"{parameters} cannot take {len(signature)} arrays and constants {consts}")
    compiled = production_kernel(kernel, generation, _artifacts_dir())
    if not callable(getattr(compiled, "compile", None)):
        raise ImportError(
            "the installed nki's CompileKernel has no compile(): neuron_compile compiles NKI kernels with nki >= 0.6"
        )
    config, _cache_key = compiled.compile(*values)
    return CompiledKernelConfig(
        backend_config=config.backend_config_b64.decode("ascii"),
        outputs=tuple((tuple(int(d) for d in s.shape), str(np.dtype(s.dtype))) for s in config.output_specs),
        operand_output_aliases=tuple(sorted((int(i), int(o)) for i, o in config.operand_output_aliases.items())),
        has_collectives=bool(config.has_collectives),
    )


_ARTIFACTS_ROOT: list[str] = []  # the process's directory, made at the first compile
_ARTIFACTS_COUNTER = itertools.count()


def _artifacts_dir() -> str:
    """A fresh directory for one kernel compile, under one per process: the compiled kernel file named in
    the backend_config must exist when neuronx-cc compiles the graph, later in this process. Removed at
    exit: a NEFF holds its kernels, and a cache hit never needs the file again."""
    if not _ARTIFACTS_ROOT:
        root = tempfile.mkdtemp(prefix="neuron_compile_nki_")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _ARTIFACTS_ROOT.append(root)
    path = os.path.join(_ARTIFACTS_ROOT[0], str(next(_ARTIFACTS_COUNTER)))
    os.makedirs(path)
    return path
