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
