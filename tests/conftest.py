import atexit
import os
import shutil
import tempfile

import pytest
import torch


def _private_dir(variable: str, prefix: str) -> None:
    """Point ``variable`` at a new directory of this process's, removed when it exits.

    Set unconditionally: tests never touch the user's real caches, and each pytest-xdist worker (which
    inherits the controller's environment) gets directories of its own. A test that needs another sets it.
    """
    path = tempfile.mkdtemp(prefix=prefix)
    os.environ[variable] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


_private_dir("NEURON_COMPILE_CACHE_DIR", "neuron_compile_test_cache_")
# PyTorch's cache directory holds AOTAutograd's entries (neuron_compile/aot_cache.py): private too.
_private_dir("TORCHINDUCTOR_CACHE_DIR", "neuron_compile_test_torch_cache_")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: torch's config modules whose options no test may leave changed or hidden. pytest >= 9.1's
#: ``monkeypatch.setattr`` on one of them undoes itself with a ``delattr``, which hides the option for the
#: rest of the process: every later compile in that worker then failed (issue 36). Use ``config.patch``.
_TORCH_CONFIGS = ("torch._functorch.config", "torch._dynamo.config", "torch._inductor.config")


def _config_state() -> dict[str, dict]:
    import importlib

    return {name: importlib.import_module(name).get_config_copy() for name in _TORCH_CONFIGS}


def _settled_config_state() -> dict[str, dict]:
    """The options as they are once the backend is in use: it sets a few of torch's process-wide at import
    (``backend.py``) and at its first compile (``graph_checks.refuse_silent_eager_fallback``), by design."""
    import neuron_compile.backend  # noqa: F401
    from neuron_compile.graph_checks import refuse_silent_eager_fallback

    refuse_silent_eager_fallback(False)
    return _config_state()


_CONFIG_AT_START = _settled_config_state()


def _config_drift(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """What changed between two ``_config_state``s, one line per option; a hidden option is restored."""
    import importlib

    drift = []
    for module_name, options in before.items():
        now = after[module_name]
        module = importlib.import_module(module_name)
        for option, value in options.items():
            if module._config[option].hide:  # get_config_copy still lists a hidden option, with its value
                drift.append(f"{module_name}.{option} was hidden (a delattr, e.g. monkeypatch's undo)")
                module._config[option].hide = False
                setattr(module, option, value)
            elif now[option] != value:
                drift.append(f"{module_name}.{option} changed: {value!r} -> {now[option]!r}")
                setattr(module, option, value)
    return drift


@pytest.fixture(autouse=True)
def _torch_config_untouched():
    """A test that leaves one of torch's config options changed or hidden fails at its teardown (the next
    test then starts from the state restored)."""
    yield
    drift = _config_drift(_CONFIG_AT_START, _config_state())
    if drift:
        pytest.fail(
            "torch config left changed by this test (use config.patch, never monkeypatch):\n  " + "\n  ".join(drift)
        )


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
def cpu_device():
    """The ``neuron`` device on the CPU target, fresh for the test (its one-op graphs stay in the process's table)."""
    import neuron_compile
    from neuron_compile import STATS, Options
    from neuron_compile.device import context

    neuron_compile.device.register()
    context.reset_for_tests(Options.from_user({"target": "cpu"}))
    STATS.reset()
    yield context.device()
    context.reset_for_tests()


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
