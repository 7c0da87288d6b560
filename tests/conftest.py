import os
import tempfile

import pytest
import torch

# Tests never touch the user's real cache; each session gets a fresh one unless a test sets its own.
os.environ.setdefault("NEURON_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="neuron_compile_test_cache_"))
# PyTorch's cache directory holds AOTAutograd's entries (neuron_compile/aot_cache.py): private too.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="neuron_compile_test_torch_cache_"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
