"""The package's layering, as docs/architecture.md draws it: who may import whom, no import cycle, and a
package root that does not pay for jax or the lowerings."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "neuron_compile"

#: Units that everything may use: plain data types, options, errors, provenance strings.
BASE = {"version", "errors", "dtypes", "options", "provenance", "stats", "artifact"}
#: unit -> the units it may import besides BASE and itself (docs/architecture.md, "Who imports whom").
ALLOWED: dict[str, set[str]] = {
    **{unit: set() for unit in BASE},
    # the "auto" target asks runtime.libnrt where libnrt.so.1 is (ctypes only), inside a function
    "options": {"runtime"},
    "graph_checks": set(),
    "recompiles": {"graph_checks"},
    "value_checks": {"provenance"},
    "decompositions": set(),
    "trace_fixes": {"decompositions"},
    "debug": set(),
    "heap": set(),
    "runtime": set(),
    "kernels": set(),
    "nki": {"kernels"},
    "distributed": set(),
    "lowering": {"graph_checks", "kernels", "distributed", "decompositions"},
    "legality": {"lowering", "runtime"},
    # the HBM estimate names a tensor's aten node and user line through the legality pass's MLIR locations
    "hbm": {"legality"},
    "cache": {"graph_checks", "runtime"},
    "compiler": {
        "cache",
        "debug",
        "distributed",
        "heap",
        "graph_checks",
        "hbm",
        "kernels",
        "legality",
        "lowering",
        "runtime",
        "value_checks",
    },
    "aot_cache": {"cache", "compiler", "kernels"},
    "backend": {
        "aot_cache",
        "cache",  # the precompile recorder (cache/collect.py), installed when collecting
        "compiler",
        "decompositions",
        "graph_checks",
        "heap",
        "lowering",
        "kernels",
        "recompiles",
        "trace_fixes",
    },
    "__init__": {"cache", "kernels", "nki", "lowering", "evaluate", "bucketing", "device"},
    # the neuron device: its graphs go through the compiler; executor.DEVICE_CALL is its hook into the runtime,
    # value_checks.DEFERRED_CHECKS into the checks of graphs
    # hbm: the one table of HBM per core (its memory limit)
    "device": {"cache", "compiler", "decompositions", "graph_checks", "hbm", "runtime", "value_checks"},
    "evaluate": {"backend", "cache", "compiler", "graph_checks", "hbm", "kernels", "lowering", "runtime", "debug"},
    "bucketing": set(),
    "cli": {"cache", "evaluate", "doctor", "precompile"},
    "precompile": {"cache", "compiler", "runtime"},
    "doctor": {"cache", "runtime", "kernels", "debug", "hbm"},  # hbm: the HBM per core it shows
    "demo": {"cache", "device", "hbm"},  # device: --device neuron registers it on the CPU target
}


#: The modules of user-facing commands: each may load the others (``cli`` dispatches to them); no other module
#: imports one (the backend installs the precompile recorder from ``cache/collect.py``, not from the command).
COMMAND_MODULES = {
    "neuron_compile.cli",
    "neuron_compile.demo",
    "neuron_compile.doctor",
    "neuron_compile.evaluate.cli",
    "neuron_compile.precompile",
}


def _unit(module: str) -> str:
    """'neuron_compile.cache.store' -> 'cache'; 'neuron_compile' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported neuron_compile module, line, at module level) of every import in ``path``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` imports are for annotations only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            top_level.discard(id(node))
            for inner in ast.walk(node):
                inner.type_checking = True
    found = []
    for node in ast.walk(tree):
        if getattr(node, "type_checking", False):
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from . import x` may name submodules: count each as imported.
            targets = [prefix] if node.module else [f"{prefix}.{a.name}" for a in node.names]
        for target in targets:
            if target == "neuron_compile" or target.startswith("neuron_compile."):
                found.append((target, node.lineno, id(node) in top_level))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layering(path: Path) -> None:
    unit = _unit(_module_name(path))
    assert unit in ALLOWED, f"{path.name}: new unit '{unit}': add it to ALLOWED and docs/architecture.md"
    allowed = ALLOWED[unit] | BASE | {unit}
    bad = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target} (unit '{_unit(target)}')"
        for target, line, _ in _imports(path)
        if _unit(target) not in allowed
    ]
    assert not bad, f"unit '{unit}' may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_no_module_imports_a_command_module() -> None:
    modules = {_module_name(path) for path in SOURCES}
    assert COMMAND_MODULES <= modules, COMMAND_MODULES - modules
    bad = []
    for path in SOURCES:
        if _module_name(path) in COMMAND_MODULES:
            continue
        for target, line, _ in _imports(path):
            while target not in modules and "." in target:  # `from pkg.mod import name` names an attribute
                target = target.rpartition(".")[0]
            if target in COMMAND_MODULES:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports the command module {target}")
    assert not bad, "\n".join(bad)


#: The one module that may use jax's private modules (``jax._src``, jaxlib's submodules): jax is pinned to one
#: version for it (pyproject.toml), and a jax upgrade is checked in one file. Everywhere else uses jax's public
#: paths (``jax.extend.mlir``, ``jax.interpreters.mlir``).
PRIVATE_JAX_MODULE = "runtime/jax_adapter.py"


def _private_jax_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Attribute) and node.attr == "_src" and ast.unparse(node.value) == "jax":
            names = ["jax._src"]
        found += [f"{node.lineno}: {n}" for n in names if n.startswith(("jax._src", "jaxlib."))]
    return found


def test_only_the_jax_adapter_uses_private_jax() -> None:
    used = {str(p.relative_to(PACKAGE)): _private_jax_uses(p) for p in SOURCES}
    assert used[PRIVATE_JAX_MODULE], f"{PRIVATE_JAX_MODULE} uses no private jax: the rule names the wrong module"
    elsewhere = [f"{path}:{use}" for path, uses in used.items() if path != PRIVATE_JAX_MODULE for use in uses]
    assert not elsewhere, f"private jax outside {PRIVATE_JAX_MODULE} (add a function there):\n" + "\n".join(elsewhere)


def test_no_import_cycle_between_units() -> None:
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        unit = _unit(_module_name(path))
        for target, _, _ in _imports(path):
            if _unit(target) != unit:
                edges.setdefault(unit, set()).add(_unit(target))

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return trail + [start]
                if nxt not in trail:
                    stack.append((nxt, trail + [nxt]))
        return None

    for unit in edges:
        cycle = cycle_from(unit)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_modules() -> None:
    """Not even through an import inside a function: a module that needs its importer back gets a hook
    set by the importer instead (cache/megacache.py's ``store_for_loading``)."""
    modules = {_module_name(path) for path in SOURCES}
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        module = _module_name(path)
        for target, _, _ in _imports(path):
            while target not in modules and "." in target:  # `from pkg.mod import name` names an attribute
                target = target.rpartition(".")[0]
            if target != module and target in modules:
                edges.setdefault(module, set()).add(target)
    graph = nx.DiGraph([(a, b) for a, targets in edges.items() for b in targets])
    cycles = [" -> ".join(c + c[:1]) for c in nx.simple_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    ["import neuron_compile", "import neuron_compile.backend", "from neuron_compile import Options, cache_stats"],
)
def test_light_imports_do_not_load_jax_or_lowerings(code: str) -> None:
    loaded = _modules_after(code)
    heavy = sorted(
        m for m in loaded if m == "jax" or m.startswith(("neuron_compile.lowering", "neuron_compile.legality"))
    )
    assert not heavy, f"`{code}` imported {heavy}"


def _console_script() -> tuple[str, str]:
    """(module, function) of the ``neuron-compile`` entry point, as pyproject.toml declares it."""
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["neuron-compile"].partition(":")
    return module, function


def _subcommand_helps() -> list[list[str]]:
    """``--help`` of the command and of every command group and command it has."""
    import argparse

    module, _ = _console_script()
    found: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        found.append([*path, "--help"])
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])

    walk(importlib.import_module(module).build_parser(), [])
    return found


@pytest.mark.parametrize("argv", _subcommand_helps(), ids=" ".join)
def test_cli_help_imports_neither_torch_nor_jax(argv: list[str]) -> None:
    """``neuron-compile ... --help`` answers without torch (seconds to import; ``import neuron_compile``
    registers the neuron device, so the parser lives outside the package)."""
    module, function = _console_script()
    code = (
        f"import contextlib, io\nfrom {module} import {function}\n"  # the help text must not mix with the module list
        f"with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        {function}({argv!r})\n"
        "    except SystemExit:\n        pass"
    )
    loaded = _modules_after(code)
    heavy = sorted(m for m in loaded if m in ("torch", "jax", "neuron_compile"))
    assert not heavy, f"`neuron-compile {' '.join(argv)}` imported {heavy}"


def test_every_cli_command_names_a_function_of_the_commands_module() -> None:
    """The parser names each command's function by string (it must not import the package): each one exists."""
    import argparse

    module, _ = _console_script()
    cli = importlib.import_module(module)
    commands = importlib.import_module(cli.COMMANDS)
    named: list[str] = []

    def walk(parser: argparse.ArgumentParser) -> None:
        if parser.get_default("fn") is not None:
            named.append(parser.get_default("fn"))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(cli.build_parser())
    assert len(named) >= 11, named
    missing = [name for name in named if not callable(getattr(commands, name, None))]
    assert not missing, f"{cli.COMMANDS} has no {missing}"
