import os
import tempfile

import pytest
import torch

# Tests never touch the user's real cache; each session gets a fresh one unless a test sets its own.
os.environ.setdefault("NEURON_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="neuron_compile_test_cache_"))
# PyTorch's cache directory holds AOTAutograd's entries (neuron_compile/aot_cache.py): private too.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="neuron_compile_test_torch_cache_"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _drop_compiled_fn_globals() -> None:
    """Dynamo stores each compiled graph in the globals of the compiled function's module
    (``__compiled_fn_<n>_<uuid>``) and deletes it when the transformed code dies, which ``torch._dynamo.reset()``
    brings about in most cases, not all (a compiled function whose ``backward()`` breaks the graph keeps its
    graphs, in every backend). Whatever is left would keep its XLA executable alive, ~3 memory maps per
    JIT-compiled kernel: before jax's tracebacks were scoped (``jax_adapter.traceback_scope``) that was every
    graph of the suite, and late in the suite the process reached Linux's vm.max_map_count (65,530) and died
    (a segfault in the C++ unwinder, from ``executable.serialize()``)."""
    # Dynamo's own record of the globals it installed, per transformed code still alive (a walk of every
    # module's globals instead took ~14 ms per test: ~40 s of the suite).
    from torch._dynamo.utils import CleanupManager

    for hooks in list(CleanupManager.instance.values.values()):
        for hook in hooks:
            if hook.name.startswith("__compiled_fn_") and hook.name in hook.scope:
                hook.scope[hook.name] = None  # not deleted: Dynamo's own cleanup deletes the name when the code dies


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    _drop_compiled_fn_globals()


@pytest.fixture
def builds(monkeypatch):
    """Counts real compiles (cache misses that lower and compile): the names of the graphs built."""
    import neuron_compile.compiler as compiler_mod

    calls = []
    real = compiler_mod.build_artifact

    def counting(gm, example_inputs, opts, name):
        calls.append(name)
        return real(gm, example_inputs, opts, name)

    monkeypatch.setattr(compiler_mod, "build_artifact", counting)
    return calls
