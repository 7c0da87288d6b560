"""Runs PyTorch's OpInfo samples through ``torch.compile(backend="neuron")`` and classifies each case.

Shared by ``tests/test_opinfo.py`` (a bounded, deterministic sample of cases in CI), the test modules that
judge results by its rule (``compare``: eager's tolerance for the dtype, else no further from a float64
reference than eager), and ``tools/opinfo_sweep.py`` (the full sweep that writes ``docs/opinfo_results.json``).

A *case* is (OpInfo entry, dtype, sample). Each case ends in exactly one outcome:

- ``PASS``: the compiled function returned what eager returns (values, dtype, shape; and float32
  gradients for ops that support autograd).
- ``UNSUPPORTED``: our clear error (``NeuronUnsupportedOpError``) was raised, usually wrapped by Dynamo's
  ``BackendCompilerFailed``.
- ``SKIP``: a listed, explained category (see ``SKIP_REASONS``) in which an exact comparison with eager
  is not meaningful or the backend never sees the op.
- ``FAIL``: anything else: a value/dtype/shape that differs from eager, or a crash that is not our
  clear error. There is no list of known-wrong results.
"""

from __future__ import annotations

import copy
import itertools
import math
import traceback
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree

PASS, UNSUPPORTED, SKIP, FAIL = "PASS", "UNSUPPORTED", "SKIP", "FAIL"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}

#: Tested only when named (``opinfo_sweep --dtypes float32,complex64``): not in CI's rotation nor in the
#: default sweep. complex64 runs as (real, imag) float32 pairs (neuron_compile/lowering/complex_pairs.py); uint8
#: is the dtype of images (wrap-around arithmetic, fixed-point resampling kernels in eager); int8/int16/int32
#: are quantized weights and indices (wrap-around, integer division and shifts at narrow widths).
OPT_IN_DTYPES: dict[str, torch.dtype] = {
    "complex64": torch.complex64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
}

#: The explained skip categories. Each case's ``detail`` names one of these keys.
SKIP_REASONS: dict[str, str] = {
    "random": "random op: compiled and eager draw from different generators, so outputs are compared by "
    "shape, dtype and finiteness only",
    "undefined-values": "the op's output values are undefined (torch.empty and friends): compared by shape "
    "and dtype only",
    "not-captured": "Dynamo cannot capture the op in one graph (data-dependent output shape, .item(), "
    "unsupported Python construct, or an internal Dynamo error) before any graph reaches the backend",
    "no-graph": "Dynamo produced no graph for the backend (the op is resolved at trace time, e.g. it only "
    "reads metadata): nothing to compile",
    "eager-error": "eager PyTorch itself raises on this sample",
    "tie-order": "the sample has ties, whose index order torch leaves unspecified (non-stable sort, topk, "
    "kthvalue, mode; eager's order comes from its introsort/quickselect): values are compared exactly and every "
    "index is checked to select the eager value (and sort's to be a permutation); gradients, which follow "
    "the tie order, are not compared",
}

#: Entries whose index outputs are unspecified among ties: (default dim, position of dim in args).
#: mode: eager's CPU kernel picks the index of the winning value from a std::sort of (value, index) pairs,
#: stable up to 16 elements (insertion sort, the value's last occurrence, which the lowering returns) and
#: introsort's arbitrary order of equal values beyond; torch documents no choice among them.
TIE_ORDER_OPS: dict[str, int] = {"sort": 0, "argsort": 0, "topk": 1, "kthvalue": 1, "mode": 0}

#: Entries that return eigenvectors or singular vectors: unique only up to sign (a basis of a repeated value's
#: space), and torch documents that devices differ in them. Compared, as OpInfo's own gradient tests do, through
#: the sample's sign-invariant ``output_process_fn_grad`` (values, |vectors| of the k = min(m, n) columns).
SIGN_FREE_OPS = frozenset({"linalg.eigh", "linalg.svd", "svd"})

#: OpInfo entries whose outputs are random: compared by shape/dtype/finiteness only.
RANDOM_OPS = frozenset(
    {
        "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
        "normal.in_place", "normal.number_mean", "rand_like", "randint", "randint_like", "randn",
        "randn_like", "uniform", "nn.functional.alpha_dropout", "nn.functional.dropout",
        "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.feature_alpha_dropout.with_train",
        "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "nn.functional.rrelu",
        "pca_lowrank", "svd_lowrank",
    }
)  # fmt: skip


def entry_name(op: Any) -> str:
    """The OpInfo's unique name: ``name`` or ``name.variant_test_name``."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo database (needs ``expecttest``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return list(op_db)


def tested_dtypes(op: Any, opt_in: Iterable[str] = ()) -> list[str]:
    """Names of the dtypes of ``DTYPES`` (and of the ``opt_in`` ones of ``OPT_IN_DTYPES``) that the op
    supports on CPU."""
    supported = op.supported_dtypes("cpu")
    table = {**DTYPES, **{name: OPT_IN_DTYPES[name] for name in opt_in}}
    return [name for name, dt in table.items() if dt in supported]


def _seed_for(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


def samples(op: Any, dtype_name: str, limit: int | None, with_grad: bool) -> list[Any]:
    """The first ``limit`` CPU samples of ``op`` for ``dtype_name`` (all if None), generated reproducibly."""
    torch.manual_seed(_seed_for(entry_name(op), dtype_name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = op.sample_inputs("cpu", {**DTYPES, **OPT_IN_DTYPES}[dtype_name], requires_grad=with_grad)
        return list(itertools.islice(gen, limit))


def describe_sample(sample: Any) -> str:
    """A short, readable description of a sample's arguments (tensors as dtype[shape])."""

    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(show(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        return repr(x)

    parts = [show(sample.input)] + [show(a) for a in sample.args]
    parts += [f"{k}={show(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)


# ---- what the backend sees ---------------------------------------------------------------------------
@dataclass
class _Recorder:
    """Collects the aten graphs handed to the neuron compiler during one case."""

    graphs: int = 0
    ops: set[str] = field(default_factory=set)
    bad_tensors: set[str] = field(default_factory=set)
    #: aten op -> generation -> legality verdict (an ``OpVerdict``), the worst over the lowered graphs.
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, gm: torch.fx.GraphModule) -> None:
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                self.ops.add(str(node.target))
            vals = node.meta.get("val")
            for v in vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(v, torch.Tensor):
                    if v.layout != torch.strided:  # complex is not bad: it runs as (real, imag) pairs
                        self.bad_tensors.add("sparse")

    def record_legality(self, lowered: Any) -> None:
        """Per-aten-op trn2/trn3 verdicts of one lowered graph, merged into what this case saw."""
        from neuron_compile import legality

        try:
            per_op = legality.verdicts_by_op(lowered)
        except Exception as e:
            crashed = legality.OpVerdict(False, (), (f"legality pass crashed: {type(e).__name__}: {_short(e)}",))
            ops = {info["op"] for info in getattr(lowered, "node_table", {}).values()}
            per_op = {op: {gen: crashed for gen in legality.rules.GENERATIONS} for op in ops}
        for op, by_gen in per_op.items():
            mine = self.verdicts.setdefault(op, {})
            for gen, v in by_gen.items():
                mine[gen] = legality.merge_verdicts(mine.get(gen), v)


_RECORDER: _Recorder | None = None
_installed = False


def _install_recorder() -> None:
    """Observe the compiler through its hooks, so each case learns which aten ops reached the backend
    and their trn2/trn3 legality verdicts (from every graph that lowered, legal or not; a compile cache
    hit skips the lowering, which is why the sweep runs with the cache off)."""
    global _installed
    if _installed:
        return
    from neuron_compile.compiler import HOOKS

    def on_graph(gm: torch.fx.GraphModule) -> None:
        if _RECORDER is not None:
            _RECORDER.record(gm)

    def on_lowered(lowered: Any) -> None:
        if _RECORDER is not None:
            _RECORDER.record_legality(lowered)

    HOOKS.on_graph.append(on_graph)
    HOOKS.on_lowered.append(on_lowered)
    _installed = True


# ---- one case ----------------------------------------------------------------------------------------
@dataclass
class CaseResult:
    entry: str
    dtype: str
    index: int
    outcome: str
    detail: str = ""
    sample: str = ""
    grad: bool = False
    ops: list[str] = field(default_factory=list)
    bad_tensors: list[str] = field(default_factory=list)
    graphs: int = 0
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Every float64-reference verdict taken for this case (see ``accuracy_distances``).
    accuracy: list[dict[str, Any]] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.entry} [{self.dtype} #{self.index}] ({self.sample}): {self.outcome} {self.detail}".rstrip()


def _clone_tree(tree: Any) -> Any:
    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            c = x.detach().clone()
            return c.requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(clone, tree)


def make_call(func: Callable, sample: Any) -> tuple[list[torch.Tensor], Callable[..., Any]]:
    """The sample's tensors and a function ``f(*tensors)`` calling ``func`` on the sample's arguments.

    The function is generated as source (``def f(t0, t1): return func(t0, [t1], dim=C0)``) so that Dynamo
    traces only the op call, not the code that rebuilds nested arguments: that rebuild costs Dynamo more
    than the rest of the compile.
    """
    tensors: list[torch.Tensor] = []
    consts: dict[str, Any] = {"func": func}

    def expr(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return f"t{len(tensors) - 1}"
        if type(x) in (list, tuple):
            inner = "".join(f"{expr(v)}, " for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if type(x) is dict and all(isinstance(k, str) for k in x):
            return "{" + "".join(f"{k!r}: {expr(v)}, " for k, v in x.items()) + "}"
        name = f"C{len(consts)}"
        consts[name] = x
        return name

    call = [expr(sample.input)] + [expr(a) for a in sample.args]
    call += [f"{k}={expr(v)}" for k, v in sample.kwargs.items()]
    params = ", ".join(f"t{i}" for i in range(len(tensors)))
    source = f"def opinfo_case({params}):\n    return func({', '.join(call)})\n"
    namespace = dict(consts)
    exec(compile(source, "<opinfo_case>", "exec"), namespace)
    return tensors, namespace["opinfo_case"]


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def classify_exception(exc: BaseException, reached_backend: bool) -> tuple[str, str]:
    """(outcome, detail) of a compile/run exception."""
    from neuron_compile.errors import NeuronUnsupportedOpError

    chain = _chain(exc)
    for e in chain:
        if isinstance(e, NeuronUnsupportedOpError):
            reasons = sorted({f"{n.op}: {n.reason}" for n in e.nodes})
            return UNSUPPORTED, "; ".join(reasons)[:600]
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    if not reached_backend and not any(isinstance(e, BackendCompilerFailed) for e in chain):
        # Dynamo refused (or failed) to capture the op before any graph reached the backend.
        if any(isinstance(e, TorchDynamoException) for e in chain):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return SKIP, f"not-captured: {first[:300]}"
    return FAIL, f"crash: {type(chain[-1]).__name__}: {_short(chain[-1])}"


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:400]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    dtype: torch.dtype | None = None


#: torch.testing.assert_close defaults; float64 results are computed in float32 on the device.
DEFAULT_TOL = {
    torch.float32: Tolerance(1.3e-6, 1e-5, torch.float32),
    torch.float64: Tolerance(1.3e-6, 1e-5, torch.float32),
    torch.bfloat16: Tolerance(1.6e-2, 1e-5, torch.bfloat16),
    torch.complex64: Tolerance(1.3e-6, 1e-5, torch.float32),  # assert_close's complex64 = float32 defaults
    torch.complex128: Tolerance(1.3e-6, 1e-5, torch.float32),  # computed as complex64, as float64 as float32
    torch.float16: Tolerance(1e-3, 1e-5, torch.float16),
}


#: The low-precision verdict: a compiled value that misses eager's tolerance still passes when its
#: distance to the float64 reference is at most ``ACCURACY_MULTIPLE`` times eager's own distance, plus
#: one ulp of the dtype at the reference's scale (and the dtype's atol). Distance is the root-mean-square
#: error over the elements the reference finds finite, the measure of torch's own accuracy checker
#: (``torch._dynamo.utils.same`` with ``fp64_ref``, multiplier 2). This tells torch's own rounding quirks
#: (eager's vectorized bfloat16 kernels round intermediates) apart from ours.
ACCURACY_MULTIPLE = 2.0


def accuracy_distances(a: torch.Tensor, e: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
    """Distances of compiled ``a`` and eager ``e`` to the float64 reference ``r`` and the verdict.

    Returns {"compiled", "eager", "bound", "ok"}; non-finite values must sit where the reference has
    them (NaN for NaN, the same infinity), else ``ok`` is False and the distance is inf.

    Where eager itself is NaN or infinite and the reference is finite (eager's 16-bit ``matrix_exp`` gives
    NaN), eager is no yardstick: ``compiled`` is then judged against the reference rounded to the dtype
    (an overflow to inf is the correct rounding), within ``ACCURACY_MULTIPLE`` ulps of the reference's scale.
    """
    if a.is_complex() or e.is_complex() or r.is_complex():  # judged on (real, imag) pairs
        a, e, r = (torch.view_as_real(t.detach().resolve_conj().to(torch.complex128)) for t in (a, e, r))
    a, e, r = a.detach().double(), e.detach().double(), r.detach().double()
    if a.shape != r.shape:
        return {"compiled": math.inf, "eager": math.nan, "bound": math.nan, "ok": False}
    finite = r.isfinite()

    def distance(x: torch.Tensor) -> float:
        if not bool(torch.equal(x[~finite].nan_to_num(0, 1, -1), r[~finite].nan_to_num(0, 1, -1))) or bool(
            (x[~finite].isnan() != r[~finite].isnan()).any()
        ):
            return math.inf
        d = (x[finite] - r[finite]).double()
        return float(d.square().mean().sqrt()) if d.numel() else 0.0

    compiled, eager = distance(a), distance(e)
    scale = float(r[finite].square().mean().sqrt()) if bool(finite.any()) else 0.0
    ulp = torch.finfo(tol.dtype).eps if tol.dtype is not None else 0.0
    if tol.dtype is not None and bool((finite & ~e.isfinite()).any()):
        r = r.to(tol.dtype).double()
        finite = r.isfinite()
        compiled = distance(a)
        scale = float(r[finite].square().mean().sqrt()) if bool(finite.any()) else 0.0
        bound = ACCURACY_MULTIPLE * ulp * scale + tol.atol
        return {"compiled": compiled, "eager": eager, "bound": bound, "ok": compiled <= bound}
    bound = ACCURACY_MULTIPLE * eager + ulp * scale + tol.atol
    return {"compiled": compiled, "eager": eager, "bound": bound, "ok": compiled <= bound}


def describe_distances(d: dict[str, Any]) -> str:
    if not math.isfinite(d["eager"]):
        return (
            f"float64-reference RMS error: compiled {d['compiled']:.3g}, eager {d['eager']:.3g} (not finite "
            f"where the reference is), bound {ACCURACY_MULTIPLE:g} ulp of the rounded reference = {d['bound']:.3g}"
        )
    return (
        f"float64-reference RMS error: compiled {d['compiled']:.3g}, eager {d['eager']:.3g}, "
        f"bound {ACCURACY_MULTIPLE:g}x eager + 1 ulp = {d['bound']:.3g}"
    )


def compare(
    actual: Any, expected: Any, what: str, values: bool = True, reference: Any = None, notes: list | None = None
) -> str | None:
    """None if equal (within tolerance), else a description of the first difference.

    ``reference`` (a callable giving the float64 result of the same structure) is consulted only for a
    floating-point tensor that misses the tolerance of eager: see ``accuracy_distances``. Each such
    consultation is appended to ``notes`` ({"where", "compiled", "eager", "bound", "ok"}).
    """
    a_leaves = pytree.tree_leaves(actual)
    e_leaves = pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return f"{what}: {len(a_leaves)} outputs, eager has {len(e_leaves)}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{what}[{i}]" if len(a_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{where}: got {type(a).__name__}, eager returns a tensor"
            if a.dtype != e.dtype:
                return f"{where}: dtype {a.dtype}, eager {e.dtype}"
            if a.shape != e.shape:
                return f"{where}: shape {list(a.shape)}, eager {list(e.shape)}"
            if not values:
                continue
            tol = DEFAULT_TOL.get(e.dtype, Tolerance(0, 0))
            try:
                torch.testing.assert_close(
                    a.detach(), e.detach(), rtol=tol.rtol, atol=tol.atol, equal_nan=True, check_stride=False
                )
            except AssertionError as err:
                ref = reference() if reference is not None and (e.is_floating_point() or e.is_complex()) else None
                r = pytree.tree_leaves(ref)[i] if ref is not None else None
                if isinstance(r, torch.Tensor):
                    d = accuracy_distances(a, e, r, tol)
                    if notes is not None:
                        notes.append({"where": where, **{k: v for k, v in d.items()}})
                    if d["ok"]:
                        continue
                    return f"{where}: values differ; {describe_distances(d)}: " + " ".join(str(err).split())[:400]
                return f"{where}: values differ: " + " ".join(str(err).split())[:500]
        elif a is None and e is None:
            continue
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=1.3e-6, abs_tol=1e-5)):
                return f"{where}: {a!r}, eager {e!r}"
        elif a != e:
            return f"{where}: {a!r}, eager {e!r}"
    return None


def random_check(actual: Any, expected: Any) -> str | None:
    """Random outputs: same structure, dtypes and shapes, and no NaN/inf where eager has none."""
    bad = compare(actual, expected, "output", values=False)
    if bad:
        return bad
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
        if isinstance(e, torch.Tensor) and (e.is_floating_point()) and bool(torch.isfinite(e).all()):
            if not bool(torch.isfinite(a).all()):
                return "random output has non-finite values where eager has none"
    return None


def _tie_order_check(prep: "_Prepared", actual: Any) -> str | None:
    """None when ``actual`` differs from eager only in the order of tied elements (see SKIP_REASONS)."""
    sample, name = prep.sample, entry_name(prep.op)
    if sample.kwargs.get("stable", False):
        return "stable sort: indices must equal eager's"
    dim_pos = TIE_ORDER_OPS[name]
    dim = sample.kwargs.get("dim", sample.args[dim_pos] if len(sample.args) > dim_pos else -1)
    x = sample.input.detach()
    if name == "argsort":
        indices, eager_indices = actual, prep.expected
        values = eager_values = None
    else:
        (values, indices), (eager_values, eager_indices) = actual, prep.expected
        bad = compare(values, eager_values, "values")
        if bad:
            return bad
    if indices.dtype != eager_indices.dtype or indices.shape != eager_indices.shape:
        return f"indices: {indices.dtype}{list(indices.shape)}, eager {eager_indices.dtype}{list(eager_indices.shape)}"
    if x.dim() == 0:
        return None if torch.equal(indices, eager_indices) else "indices of a 0-d input differ"
    gather_idx = indices if (indices.dim() == x.dim()) else indices.unsqueeze(dim)
    eager_gather = eager_indices if (eager_indices.dim() == x.dim()) else eager_indices.unsqueeze(dim)
    if bool(((gather_idx < 0) | (gather_idx >= x.shape[dim])).any()):
        return "indices out of range"
    picked, eager_picked = x.gather(dim, gather_idx), x.gather(dim, eager_gather)
    if not torch.equal(picked.isnan(), eager_picked.isnan()) or not torch.equal(
        picked.nan_to_num(0), eager_picked.nan_to_num(0)
    ):
        return "indices select values other than eager's"
    if name in ("sort", "argsort") and not torch.equal(
        indices.sort(dim).values, torch.arange(x.shape[dim]).expand_as(indices.movedim(dim, -1)).movedim(-1, dim)
    ):
        return "sort indices are not a permutation"
    return None


def _grad_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


@dataclass
class _Prepared:
    """One case with its eager result, ready to be compared with a compiled run."""

    op: Any
    result: CaseResult
    tensors: list[torch.Tensor]
    call: Callable[..., Any]
    process: Callable[[Any], Any]
    seed: int
    eager_inputs: list[torch.Tensor]
    expected: Any
    with_grad: bool
    sample: Any


def _prepare(op: Any, dtype_name: str, index: int, sample: Any, with_grad: bool) -> _Prepared | CaseResult:
    """Run eager on the sample; a finished CaseResult if eager itself raises."""
    name = entry_name(op)
    result = CaseResult(name, dtype_name, index, FAIL, sample=describe_sample(sample), grad=with_grad)
    tensors, call = make_call(op.op, sample)
    seed = _seed_for(name, dtype_name, str(index))
    eager_inputs = _clone_tree(tensors)
    try:
        torch.manual_seed(seed)
        expected = call(*eager_inputs)
    except Exception as e:
        result.outcome, result.detail = SKIP, f"eager-error: {type(e).__name__}: {_short(e)}"
        return result
    process = sample.output_process_fn_grad
    return _Prepared(op, result, tensors, call, process, seed, eager_inputs, expected, with_grad, sample)


def _compile_and_run(preps: list[_Prepared], recorder: _Recorder) -> list[tuple[list, Any]]:
    """Compile one function calling the op on every prepared case; return each case's (inputs, outputs).

    Raises what compiling or running raised; ``recorder`` learns what reached the backend.
    """
    global _RECORDER
    _install_recorder()
    inputs = [_clone_tree(p.tensors) for p in preps]
    sizes = [len(p.tensors) for p in preps]
    calls = [p.call for p in preps]

    def batched(*ts: torch.Tensor) -> tuple[Any, ...]:
        outs, at = [], 0
        for call, n in zip(calls, sizes):
            outs.append(call(*ts[at : at + n]))
            at += n
        return tuple(outs)

    fn = preps[0].call if len(preps) == 1 else batched
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)
    _RECORDER = recorder
    try:
        # A hit of AOTAutograd's cache (neuron_compile/aot_cache.py) would not reach the backend at all,
        # and the recorder must see every graph.
        with torch._functorch.config.patch(enable_autograd_cache=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(preps[0].seed)
            flat = [t for ts in inputs for t in ts]
            outs = (compiled(*flat),) if len(preps) == 1 else compiled(*flat)
            return list(zip(inputs, outs))
    finally:
        _RECORDER = None


def _check(prep: _Prepared, c_inputs: list, actual: Any, recorder: _Recorder) -> CaseResult:
    """Compare one case's compiled outputs (and gradients) with eager; finishes and returns its result."""
    result = prep.result
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = (
                _backward(prep.process, actual, prep.expected, c_inputs, prep.eager_inputs, prep.seed)
                if prep.with_grad
                else None
            )
    except _GradMismatch as e:
        result.outcome, result.detail = FAIL, f"grad: {e}"
        return _finish(result, recorder)
    except Exception as e:
        result.outcome, result.detail = classify_exception(e, True)
        if result.outcome == FAIL:
            result.detail += "\n" + "".join(traceback.format_exception(e, limit=-3))[-1500:]
        return _finish(result, recorder)
    if recorder.graphs == 0:
        bad = compare(actual, prep.expected, "output")
        result.outcome, result.detail = (FAIL, f"no graph, yet {bad}") if bad else (SKIP, "no-graph")
        return _finish(result, recorder)
    if result.entry in RANDOM_OPS:
        bad = random_check(actual, prep.expected)
        result.outcome, result.detail = (FAIL, bad) if bad else (SKIP, "random")
        return _finish(result, recorder)
    if result.entry in TIE_ORDER_OPS and compare(actual, prep.expected, "output") is not None:
        bad = _tie_order_check(prep, actual)
        result.outcome, result.detail = (FAIL, bad) if bad else (SKIP, "tie-order")
        return _finish(result, recorder)
    values = not getattr(prep.op, "has_nondeterministic_output", False)
    ref = _Float64Reference(_reference_call(prep), prep.tensors, prep.process, prep.seed, grads is not None)
    notes: list[dict[str, Any]] = []
    if result.entry in SIGN_FREE_OPS:
        bad = compare(actual, prep.expected, "output", values=False)  # shapes and dtypes of every output
        bad = bad or compare(prep.process(actual), prep.process(prep.expected), "output (sign-free)",
                              reference=lambda: prep.process(ref.output()), notes=notes)  # fmt: skip
    else:
        bad = compare(actual, prep.expected, "output", values=values, reference=ref.output, notes=notes)
    if bad is None and grads is not None:
        bad = compare(grads[0], grads[1], "grad", values=values, reference=ref.grads, notes=notes)
    result.accuracy = notes
    if bad:
        result.outcome, result.detail = FAIL, bad
    elif values and notes:
        result.outcome = PASS
        result.detail = "differs from eager, as accurate: " + "; ".join(
            f"{n['where']}: {describe_distances(n)}" for n in notes
        )
    else:
        result.outcome, result.detail = (PASS, "") if values else (SKIP, "undefined-values")
    return _finish(result, recorder)


def _reference_call(prep: _Prepared) -> Callable[..., Any]:
    """The call the float64 reference makes: the case's own call (on float64 copies of its tensors), or
    for a factory function given a floating ``dtype=`` (linspace, arange, full, ...) the same call with
    dtype=float64, whose tensors otherwise would not carry the reference's precision."""
    dt = prep.sample.kwargs.get("dtype")
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt != torch.float64:
        sample = copy.copy(prep.sample)
        sample.kwargs = {**sample.kwargs, "dtype": torch.float64}
        return make_call(prep.op.op, sample)[1]
    return prep.call


def _run_prepared(prep: _Prepared) -> CaseResult:
    recorder = _Recorder()
    try:
        [(c_inputs, actual)] = _compile_and_run([prep], recorder)
    except Exception as e:
        result = prep.result
        result.outcome, result.detail = classify_exception(e, recorder.graphs > 0)
        if result.outcome == FAIL:
            result.detail += "\n" + "".join(traceback.format_exception(e, limit=-3))[-1500:]
        return _finish(result, recorder)
    finally:
        torch._dynamo.reset()
    return _check(prep, c_inputs, actual, recorder)


def run_case(op: Any, dtype_name: str, index: int, sample: Any, with_grad: bool) -> CaseResult:
    """Compile ``op`` on ``sample`` with backend="neuron", run it, and compare with eager."""
    prep = _prepare(op, dtype_name, index, sample, with_grad)
    return prep if isinstance(prep, CaseResult) else _run_prepared(prep)


# Cases compiled together as one function. XLA's compile time grows faster than linearly with the graph,
# so one batch of every sample of an entry (1440 for max_pool2d at full depth) takes many minutes where
# chunks of this size take seconds each.
BATCH_SIZE = 32


def run_cases(op: Any, case_list: Iterable[tuple[str, int, Any, bool]]) -> list[CaseResult]:
    """Run many cases of one op, compiling them together in batches of ``BATCH_SIZE`` when that works.

    One compile for many cases saves most of the per-compile cost (Dynamo, AOTAutograd, XLA). Only a
    batch in which every case passes is accepted as is; if compiling the batch raises, or any case
    does not pass, every case of the batch is rerun alone so that each gets its own, unambiguous outcome.
    """
    case_list = list(case_list)
    results: list[CaseResult] = []
    for start in range(0, len(case_list), BATCH_SIZE):
        results.extend(_run_batch(op, case_list[start : start + BATCH_SIZE]))
    return results


def _run_batch(op: Any, case_list: list[tuple[str, int, Any, bool]]) -> list[CaseResult]:
    results: list[CaseResult | None] = [None] * len(case_list)
    preps: list[tuple[int, _Prepared]] = []
    for k, case in enumerate(case_list):
        prep = _prepare(op, *case)
        if isinstance(prep, CaseResult):
            results[k] = prep
        else:
            preps.append((k, prep))
    if len(preps) > 1:
        recorder = _Recorder()
        try:
            pairs = _compile_and_run([p for _, p in preps], recorder)
            checked = [_check(p, ci, out, recorder) for (_, p), (ci, out) in zip(preps, pairs)]
            if all(r.outcome in (PASS, SKIP) for r in checked):
                for (k, _), r in zip(preps, checked):
                    results[k] = r
                return [r for r in results if r is not None]
        except Exception:
            pass
        finally:
            torch._dynamo.reset()
        # The batch consumed the eager autograd graphs: prepare each case afresh.
        preps = [(k, _prepare(op, *case_list[k])) for k, _ in preps]
    for k, prep in preps:
        results[k] = prep if isinstance(prep, CaseResult) else _run_prepared(prep)
    return [r for r in results if r is not None]


class _GradMismatch(Exception):
    pass


class _Float64Reference:
    """Eager on float64 copies of the inputs (computed on first use): the ground truth that decides
    whether a compiled result that misses eager's tolerance is merely rounded differently."""

    def __init__(self, call: Callable, tensors: list, process: Callable, seed: int, with_grad: bool) -> None:
        self.call, self.tensors, self.process, self.seed, self.with_grad = call, tensors, process, seed, with_grad
        self._result: tuple[Any, Any] | None = None

    def _compute(self) -> tuple[Any, Any]:
        if self._result is None:
            self._result = (None, None)
            inputs = [
                t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_(t.requires_grad)
                if t.is_floating_point() or t.is_complex()
                else t.detach().clone()
                for t in self.tensors
            ]
            try:
                torch.manual_seed(self.seed)
                out = self.call(*inputs)
                grads = _grads(self.process, out, inputs, self.seed) if self.with_grad else None
                self._result = (out, grads)
            except Exception:
                pass
        return self._result

    def output(self) -> Any:
        return self._compute()[0]

    def grads(self) -> Any:
        return self._compute()[1]


def _cotangents(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) for t in outs]


def _grads(process: Callable, out: Any, inputs: list, seed: int) -> list | None:
    outs = _grad_leaves(process(out))
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not wrt:
        return None
    return list(torch.autograd.grad(outs, wrt, _cotangents(outs, seed), allow_unused=True))


def _backward(process: Callable, actual: Any, expected: Any, c_inputs: list, e_inputs: list, seed: int) -> Any:
    """Gradients of sum(out * g) for a seeded random g, compiled and eager; None if nothing is differentiable."""
    e_outs = _grad_leaves(process(expected))
    c_outs = _grad_leaves(process(actual))
    e_wrt = [t for t in e_inputs if t.requires_grad]
    c_wrt = [t for t in c_inputs if t.requires_grad]
    if len(e_outs) != len(c_outs) or len(e_wrt) != len(c_wrt):
        raise _GradMismatch(f"{len(c_outs)} differentiable outputs, eager has {len(e_outs)}")
    if not e_outs or not e_wrt:
        return None
    cotangents = _cotangents(e_outs, seed)
    e_grads = torch.autograd.grad(e_outs, e_wrt, cotangents, allow_unused=True)
    # retain_graph: in a batch, one compiled graph serves the outputs of every case.
    c_grads = torch.autograd.grad(c_outs, c_wrt, cotangents, allow_unused=True, retain_graph=True)
    return list(c_grads), list(e_grads)


def _finish(result: CaseResult, recorder: _Recorder) -> CaseResult:
    result.ops = sorted(recorder.ops)
    result.bad_tensors = sorted(recorder.bad_tensors)
    result.graphs = recorder.graphs
    result.verdicts = recorder.verdicts
    return result


# ---- which cases ----------------------------------------------------------------------------------------
def cases(op: Any, per_dtype: dict[str, int | None]) -> Iterable[tuple[str, int, Any, bool]]:
    """(dtype, index, sample, with_grad) for the op, at most ``per_dtype[dtype]`` samples per dtype.

    float32 samples are made with requires_grad when the op supports autograd, so forward and gradients
    are checked by one compile.
    """
    for dtype_name in tested_dtypes(op, [d for d in per_dtype if d in OPT_IN_DTYPES]):
        limit = per_dtype.get(dtype_name, 0)
        if limit == 0:
            continue
        with_grad = dtype_name == "float32" and op.supports_autograd
        for i, s in enumerate(samples(op, dtype_name, limit, with_grad)):
            yield dtype_name, i, s, with_grad


# ---- entries: category and status ------------------------------------------------------------------------
def core_aten_ops() -> frozenset[str]:
    """aten overloads that count as "core ATen" here: tagged ``core`` by PyTorch, or kept whole on
    purpose by ``neuron_compile.decompositions.KEEP_WHOLE`` (kernels and device-friendly forms)."""
    from neuron_compile.decompositions import KEEP_WHOLE

    names = set()
    aten = torch.ops.aten
    for packet_name in dir(aten):
        packet = getattr(aten, packet_name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            if torch.Tag.core in getattr(packet, overload).tags:
                names.add(str(getattr(packet, overload)))
    for packet in KEEP_WHOLE:
        names.update(str(getattr(packet, o)) for o in packet.overloads())
    return frozenset(names)


#: Entry categories. Only "core" entries form the denominator of the float32 pass rate.
CATEGORIES: dict[str, str] = {
    "core": "float32 samples reach the backend as graphs of core-ATen (or kept-whole) ops on real strided "
    "tensors: the denominator of the pass rate",
    "non-core": "after our decompositions the graph still holds aten ops outside core ATen (linalg "
    "factorizations, FFT, special functions, ...)",
    "complex-or-sparse": "the graph holds complex or sparse tensors, which Trainium does not have",
    "not-captured": "Dynamo does not hand the op to the backend (graph break or nothing to compile)",
    "eager-error": "eager PyTorch raises on every float32 sample",
    "no-float32": "the OpInfo has no float32 variant on CPU (integer-only, complex-only, CUDA-only ops)",
}

_SHAPE_ONLY = ("random", "undefined-values")


def _status(cases: list[CaseResult]) -> str:
    if any(c.outcome == FAIL for c in cases):
        return "fail"
    if any(c.outcome == UNSUPPORTED for c in cases):
        return "unsupported"
    if any(c.outcome == PASS or c.detail.split(":")[0] in _SHAPE_ONLY for c in cases):
        return "pass"
    return "skip"


def entry_category(op: Any, f32: list[CaseResult], core: frozenset[str]) -> tuple[str, list[str]]:
    """(category, the non-core ops that put it there) from the entry's float32 cases."""
    if "float32" not in tested_dtypes(op):
        return "no-float32", []
    reached = [c for c in f32 if c.graphs > 0 or c.outcome in (PASS, UNSUPPORTED, FAIL)]
    if not reached:
        if f32 and all(c.detail.startswith("eager-error") for c in f32):
            return "eager-error", []
        return "not-captured", []
    if any(c.bad_tensors for c in reached):
        return "complex-or-sparse", []
    outside = sorted({o for c in reached for o in c.ops if o not in core})
    if outside:
        return "non-core", outside
    return "core", []


def entry_record(op: Any, results: list[CaseResult], seconds: float) -> dict[str, Any]:
    """The JSON record of one OpInfo entry: per-dtype outcome counts, aten ops met, non-PASS cases."""
    core = core_aten_ops()
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        key = r.outcome if r.outcome != SKIP else f"SKIP:{r.detail.split(':')[0]}"
        counts.setdefault(r.dtype, {}).setdefault(key, 0)
        counts[r.dtype][key] += 1
    f32 = [r for r in results if r.dtype == "float32"]
    category, outside = entry_category(op, f32, core)
    reached_f32 = [r for r in f32 if r.outcome != SKIP or r.detail.split(":")[0] in _SHAPE_ONLY]
    f32_status = _status(reached_f32) if reached_f32 else "n/a"
    status = _status(results)
    return {
        "entry": entry_name(op),
        "category": category,
        "non_core_ops": outside,
        "status": status,
        "float32": f32_status,
        "grad": bool(op.supports_autograd),
        "counts": counts,
        "ops": sorted({o for r in results for o in r.ops}),
        "seconds": round(seconds, 2),
        # Moved to the file's top-level "legality" map by results_document.
        "legality": _entry_legality(results),
        # Non-PASS cases, and PASS cases that differ from eager and passed on the float64 reference; an
        # UNSUPPORTED one keeps just the start of its reason (the file is checked in).
        "cases": [_case_record(r) for r in results if r.outcome != PASS or r.accuracy],
    }


def verdict_record(v: Any) -> dict[str, Any]:
    return {"label": v.label(), "legal": v.legal, "assumed": list(v.assumed), "reasons": list(v.reasons)}


def _verdict_of(rec: dict[str, Any]) -> Any:
    from neuron_compile.legality import OpVerdict

    return OpVerdict(rec["legal"], tuple(rec["assumed"]), tuple(rec["reasons"]))


def _entry_legality(results: list[CaseResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """aten op -> generation -> verdict record, the worst over the entry's cases."""
    from neuron_compile.legality import merge_verdicts

    merged: dict[str, dict[str, Any]] = {}
    for r in results:
        for op, by_gen in r.verdicts.items():
            for gen, v in by_gen.items():
                merged.setdefault(op, {})[gen] = merge_verdicts(merged.get(op, {}).get(gen), v)
    return {op: {gen: verdict_record(v) for gen, v in sorted(g.items())} for op, g in sorted(merged.items())}


def merge_legality(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """aten op -> {generation: verdict record (worst over all entries), "illegal_in": entries where it was
    illegal on some generation}. Ops in no lowered graph are absent (docs/ops.md: "not exercised")."""
    from neuron_compile.legality import merge_verdicts

    merged: dict[str, dict[str, Any]] = {}
    illegal_in: dict[str, set[str]] = {}
    for e in entries:
        for op, by_gen in e.get("legality", {}).items():
            for gen, rec in by_gen.items():
                v = _verdict_of(rec)
                merged.setdefault(op, {})[gen] = merge_verdicts(merged.get(op, {}).get(gen), v)
                if not v.legal:
                    illegal_in.setdefault(op, set()).add(e["entry"])
    return {
        op: {gen: verdict_record(v) for gen, v in sorted(g.items())} | {"illegal_in": sorted(illegal_in.get(op, ()))}
        for op, g in sorted(merged.items())
    }


def _case_record(r: CaseResult) -> dict[str, Any]:
    rec: dict[str, Any] = {"dtype": r.dtype, "index": r.index, "outcome": r.outcome}
    if r.outcome == UNSUPPORTED:
        rec["detail"] = r.detail[:120]
    else:
        rec["detail"], rec["sample"] = r.detail[:240], r.sample[:160]
    if r.accuracy:
        # JSON has no inf/nan: non-finite distances are kept as strings.
        rec["accuracy"] = [
            {
                k: (float(f"{v:.4g}") if math.isfinite(v) else str(v)) if isinstance(v, float) else v
                for k, v in n.items()
            }
            for n in r.accuracy
        ]
    return rec


def results_document(entries: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The whole results file: configuration, every entry, and a summary with the float32 pass rate."""
    by_cat: dict[str, int] = {}
    for e in entries:
        by_cat[e["category"]] = by_cat.get(e["category"], 0) + 1
    core = [e for e in entries if e["category"] == "core"]
    outcome_totals: dict[str, int] = {}
    for e in entries:
        for per in e["counts"].values():
            for k, v in per.items():
                outcome_totals[k] = outcome_totals.get(k, 0) + v
    summary = {
        "entries": len(entries),
        "categories": dict(sorted(by_cat.items())),
        "core_float32": {
            "denominator": len(core),
            "pass": sum(e["float32"] == "pass" for e in core),
            "unsupported": sum(e["float32"] == "unsupported" for e in core),
            "fail": sum(e["float32"] == "fail" for e in core),
        },
        "entries_failing": sorted(e["entry"] for e in entries if e["status"] == "fail"),
        "case_outcomes": dict(sorted(outcome_totals.items())),
    }
    return {
        "torch": torch.__version__,
        "config": config,
        "summary": summary,
        "legality": merge_legality(entries),
        "entries": {e["entry"]: {k: v for k, v in e.items() if k != "legality"} for e in entries},
    }
