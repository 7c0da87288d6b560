"""Run AWS's published NKI kernels, unmodified, in neuron_compile's NKI emulator and print a conformance table
(kernel, runs, matches NumPy, estimate) in Markdown, for docs/nki.md.

    python -m benchmarks.nki_samples --samples DIR [--library DIR] [--nki-version 0.8]

``--samples`` is a checkout of github.com/aws-neuron/nki-samples, ``--library`` one of
github.com/aws-neuron/nki-library; neither is part of this repository (nor needed by its tests). In this process
only, ``import nki`` / ``nki.language`` / ``nki.isa`` / ``nki.lnc`` resolve to the emulator, so the kernels run
as their authors wrote them. Every kernel module is imported (an import error is the row's result, e.g. the
legacy ``neuronxcc.nki`` namespace that Neuron 2.34 removed); the kernels with a NumPy reference below are run on
small inputs and compared; the estimate is the cost model's (trn2, one core).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from neuron_compile.kernels import cost, nki_api

BF16 = ml_dtypes.bfloat16


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _import(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the samples import their siblings by bare name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _rand(shape: tuple[int, ...], dtype: Any = np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32).astype(dtype)


def _matmul_case(m: int, k: int, n: int) -> Callable[[Callable], tuple[bool, str]]:
    def case(kernel: Callable) -> tuple[Any, Any]:
        lhs, rhs = _rand((m, k), BF16, 1), _rand((k, n), BF16, 2)
        want = lhs.astype(np.float64) @ rhs.astype(np.float64)
        return (np.ascontiguousarray(lhs.T), rhs), want

    return case


def _cumsum_case(kernel: Callable) -> tuple[Any, Any]:
    x = _rand((256, 1000))
    return (x,), np.cumsum(x.astype(np.float64), axis=-1)


def _cascaded_max_case(kernel: Callable) -> tuple[Any, Any]:
    x = _rand((4, 4096))
    return (x,), (x.max(-1, keepdims=True).astype(np.float64), x.argmax(-1)[:, None].astype(np.float64))


def _attention_cte_case(s: int) -> Callable:
    def case(kernel: Callable) -> tuple[Any, Any]:
        d = 128
        q, k, v = _rand((1, s, d), BF16, 3), _rand((1, d, s), BF16, 4), _rand((1, s, d), BF16, 5)
        scale = 1 / np.sqrt(d)
        sc = (q[0].astype(np.float64) @ k[0].astype(np.float64)) * scale
        sc = np.where(np.tril(np.ones((s, s), bool)), sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ v[0].astype(np.float64)
        return (q, k, v, scale, True), want[None]

    return case


# (module path relative to the checkout, kernel name, inputs/reference maker, rtol): kernels run with data
RUNS: dict[str, list[tuple[str, str, Callable, float]]] = {
    "samples": [
        ("src/nki_samples/tutorials/matrix_multiplication/matrix_multiplication_nki_kernels.py", n, mk, 2e-2)
        for n, mk in (
            ("nki_matmul_basic_", _matmul_case(64, 128, 512)),
            ("nki_matmul_tiled_", _matmul_case(256, 512, 1024)),
            ("nki_matmul_hoist_load_", _matmul_case(256, 512, 1024)),
            ("nki_matmul_block_free_dimension_", _matmul_case(256, 512, 2048)),
            ("nki_matmul_fully_optimized_", _matmul_case(2048, 1024, 1024)),
        )
    ],
    "library": [
        ("src/nkilib_src/nkilib/core/cumsum/cumsum.py", "cumsum", _cumsum_case, 1e-4),
        ("src/nkilib_src/nkilib/core/max/cascaded_max.py", "cascaded_max", _cascaded_max_case, 0.0),
        ("src/nkilib_src/nkilib/core/attention/attention_cte.py", "attention_cte", _attention_cte_case(512), 2e-2),
    ],
}
# kernels launched as kernel[2] (LNC-2), as their docs ask
LNC2 = {"cascaded_max", "attention_cte"}


def _library_import(root: Path, rel: str) -> Any:
    """nki-library modules are a package (relative imports): import them as ``nkilib.<...>`` from its src root."""
    src = root / "src" / "nkilib_src"
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    mod = rel.removeprefix("src/nkilib_src/").removesuffix(".py").replace("/", ".")
    return importlib.import_module(mod)


def _run_kernel(kernel: Any, make: Callable, rtol: float, version: str) -> tuple[str, str, str]:
    args, want = make(kernel)
    launch = kernel[2] if kernel.fn.__name__ in LNC2 else kernel
    try:
        got, st = nki_api.simulate(launch, stats=True, nki_version=version)(*args)
    except Exception as e:
        return "no: " + _first_line(e), "-", "-"
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    err = max(
        float(np.max(np.abs(np.asarray(g, np.float64).reshape(w.shape) - w)) / max(1e-30, float(np.max(np.abs(w)))))
        for g, w in zip(gots, wants)
    )
    ok = "yes" if err <= rtol else f"no (max rel err {err:.1e})"
    return "yes", f"{ok} (max err {err:.1e} of max)", f"{cost.estimate(st).seconds * 1e6:.1f} us"


def survey(kind: str, root: Path, version: str) -> list[tuple[str, str, str, str]]:
    rows = []
    runs = {(rel, name): (mk, rtol) for rel, name, mk, rtol in RUNS[kind]}
    if kind == "samples":
        files = sorted(p for p in root.glob("src/**/*.py") if "kernel" in p.name) + sorted(
            root.glob("contributed/*.py")
        )
    else:
        files = sorted(
            p
            for p in (root / "src" / "nkilib_src" / "nkilib").glob("**/*.py")
            if p.name != "__init__.py" and not p.name.endswith("_torch.py")
        )
    for path in files:
        rel = str(path.relative_to(root))
        try:
            mod = _library_import(root, rel) if kind == "library" else _import(path, f"sample_{path.stem}")
        except BaseException as e:
            rows.append((rel, "no (import): " + _first_line(e), "-", "-"))
            continue
        kernels = sorted(
            n for n, v in vars(mod).items() if isinstance(v, nki_api.Kernel) and v.fn.__module__ == mod.__name__
        )
        if not kernels:
            rows.append((rel, "imports (no @nki.jit kernel of its own)", "-", "-"))
        for name in kernels:
            if (rel, name) in runs:
                mk, rtol = runs[(rel, name)]
                rows.append((f"{rel}: `{name}`", *_run_kernel(getattr(mod, name), mk, rtol, version)))
            else:
                rows.append((f"{rel}: `{name}`", "imports; not run here (no reference inputs set up)", "-", "-"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=Path, help="a checkout of aws-neuron/nki-samples")
    ap.add_argument("--library", type=Path, help="a checkout of aws-neuron/nki-library")
    ap.add_argument("--nki-version", default="0.8", help="the NKI version the emulator enforces")
    args = ap.parse_args()
    nki_api.install_as_nki()  # `import nki` gives the emulator, in this process only
    print("| kernel | runs | matches NumPy | estimate (trn2) |\n|---|---|---|---|")
    for kind, root in (("samples", args.samples), ("library", args.library)):
        if root is None:
            continue
        try:
            rows = survey(kind, root, args.nki_version)
        except Exception:
            traceback.print_exc()
            continue
        for row in rows:
            print("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")


if __name__ == "__main__":
    main()
