"""``evaluate(model, example_inputs)``: compile and run one model as a user would, and report.

Phases (each announced on stderr): Dynamo's explain (graphs and breaks), a float64 reference step, eager
steps, the cold compiled step (every graph through the neuron backend; a graph it refuses is recorded and,
for this evaluation only, run in eager so the later graphs are seen too), steady compiled steps, and a warm
start (Dynamo reset, the in-process cache layer dropped, the disk cache kept).
"""

from __future__ import annotations

import copy
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Mapping

import torch
import torch._functorch.config
import torch.utils._pytree as pytree

from ..errors import NeuronCompileError, NeuronFloat64Warning, NeuronUnsupportedOpError, UnsupportedNode
from ..options import Options
from ..provenance import describe_value
from ..stats import STATS
from .numerics import DEFAULT_TOL, NumericsVerdict, TensorVerdict, compare_to_reference, merge
from .randomness import random_draws
from .report import EvaluationReport, GraphBreak, GraphEntry, advice_for, root_causes

LossFn = Callable[[Any], torch.Tensor]


def _progress(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[neuron evaluate] {message}", file=sys.stderr, flush=True)


class NothingToJudge(Exception):
    """The model returned no tensor: compiled and eager cannot be compared (``EvaluationReport.nothing_to_judge``)."""


def _no_tensor_returned(output: Any) -> str | None:
    """What ``output`` is when it holds no tensor (None when it holds one): zero tensors compared is no pass."""
    tree = dict(output.items()) if hasattr(output, "to_tuple") and hasattr(output, "keys") else output
    if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(tree)):
        return None
    shown = repr(output) if len(repr(output)) <= 80 else repr(output)[:77] + "..."
    kind = type(output).__name__
    what = "None" if output is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({shown})"
    return (
        f"the model returned {what}, no tensor: there is nothing to compare between compiled and eager. Return "
        "the model's tensors from forward (every tensor output is judged, and every gradient when training)"
    )


class PhaseTimeout(Exception):
    """A phase of ``evaluate`` ran past ``phase_timeout``: reported in ``errors`` with the phase named."""


class _PhaseAlarm:
    """``phase_timeout`` seconds per phase (SIGALRM, main thread only): each ``start`` rearms the timer."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.phase = ""
        self._installed = False
        self._previous: Any = None
        if seconds is not None:
            if not 0 < seconds < float("inf"):
                raise ValueError(f"evaluate: phase_timeout={seconds}; need a finite number of seconds > 0")
            if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
                raise ValueError("evaluate: phase_timeout needs the main thread (it uses SIGALRM)")

    def _expired(self, signum: int, frame: Any) -> None:
        raise PhaseTimeout(f"phase {self.phase!r} ran past the timeout of {self.seconds:g} s")

    def start(self, phase: str) -> None:
        self.phase = phase
        if self.seconds is not None:
            if not self._installed:
                self._previous, self._installed = signal.signal(signal.SIGALRM, self._expired), True
            # and again every second after it: code that catches the first one (Dynamo's handlers) is
            # interrupted too, until the phase gives up
            signal.setitimer(signal.ITIMER_REAL, self.seconds, min(1.0, self.seconds))

    def stop(self) -> None:
        if self._installed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self._installed = False
        self.seconds = None


def _split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def _to_float64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x.clone()


def _one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` for a report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__


def _clone(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(x.requires_grad)


def default_loss(output: Any) -> torch.Tensor:
    """The output's ``loss`` when it has one (transformers models given labels), else the sum of every
    floating-point output: every output then gets a gradient of ones."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [x for x in pytree.tree_leaves(dict(output.items()) if hasattr(output, "to_tuple") else output)
              if isinstance(x, torch.Tensor) and x.is_floating_point()]  # fmt: skip
    if not leaves:
        raise ValueError("evaluate: the model returns no floating-point tensor to backpropagate from; pass loss_fn=")
    # summed in float32 at least (a bf16 sum of many outputs is coarse), never below the reference's float64
    return sum(x.sum(dtype=torch.promote_types(x.dtype, torch.float32)) for x in leaves)


class _Step:
    """One forward (+ loss + backward when training) of a model; returns what the numerics compare."""

    def __init__(self, training: bool, loss_fn: LossFn | None) -> None:
        self.training = training
        self.loss_fn = loss_fn or default_loss

    def __call__(self, model: Callable[..., Any], params: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        args, kwargs = _map_tensors(_clone, (args, kwargs))
        if not self.training:
            with torch.no_grad():
                return {"outputs": {"output": model(*args, **kwargs)}, "grads": {}}
        for p in params.parameters():
            p.grad = None
        out = model(*args, **kwargs)
        if self.loss_fn is default_loss and (why := _no_tensor_returned(out)) is not None:
            raise NothingToJudge(why)  # rather than the default loss's "no floating-point tensor"
        loss = self.loss_fn(out)
        loss.backward()
        grads = {f"grad:{n}": p.grad for n, p in params.named_parameters() if p.grad is not None}
        return {"outputs": {"output": out, "loss": loss}, "grads": grads}


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _disable_dropout(model: torch.nn.Module) -> int:
    """Dropout draws a different random stream compiled than in eager: the copies compared run it at p=0."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            n += 1
    return n


class _CollectingBackend:
    """The neuron backend, except that a graph it refuses is recorded and run in eager.

    Only ``evaluate`` uses this, so that the unsupported ops of EVERY graph are found in one run; a normal
    ``torch.compile(backend="neuron")`` keeps failing hard on the first one.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)
        self.dynamo_graphs = 0
        self.refused: list[tuple[str, list[UnsupportedNode]]] = []
        self.errors: list[str] = []

    #: It compiles with the neuron backend, so Dynamo gives it the ops trace_fixes keeps whole.
    _neuron_compile_backend = True

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from ..backend import neuron_backend

        self.dynamo_graphs += 1
        label = f"dynamo graph {self.dynamo_graphs}"
        try:
            return neuron_backend(gm, example_inputs, options=self.options)
        except NeuronUnsupportedOpError as e:
            self.refused.append(
                (f"{label} ({e.graph_name})" if e.graph_name != "GraphModule" else label, list(e.nodes))
            )
        except NeuronCompileError as e:
            self.errors.append(f"{label}: {type(e).__name__}: {e}")
        except Exception as e:  # a crash in the backend is a finding too; the evaluation goes on
            self.errors.append(f"{label}: backend crashed: {_one_line(e)}")
        return gm.forward


def _graph_breaks(model: Callable[..., Any], args: tuple, kwargs: dict, training: bool) -> tuple[int, list[GraphBreak]]:
    from .. import backend  # noqa: F401  (sets capture_dynamic_output_shape_ops, as a neuron compile would)

    torch._dynamo.reset()
    args, kwargs = _map_tensors(_clone, (args, kwargs))
    ctx = torch.enable_grad() if training else torch.no_grad()
    with ctx:
        explained = torch._dynamo.explain(model)(*args, **kwargs)
    breaks = []
    for r in explained.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        reason = r.reason.strip().splitlines()[0] if r.reason.strip() else "graph break"
        detail = next((ln.strip() for ln in r.reason.splitlines() if ln.strip().startswith("Explanation:")), "")
        text = f"{reason} {detail}".strip()
        breaks.append(GraphBreak(text, frame.filename if frame else "<unknown>", frame.lineno if frame else None,
                                 advice_for(r.reason)))  # fmt: skip
    torch._dynamo.reset()
    return explained.graph_count, breaks


def _reference_step(model: torch.nn.Module, step: _Step, args: tuple, kwargs: dict) -> tuple[dict[str, Any], str]:
    """The reference run: a float64 copy of the model where it runs, else float32 (and say why)."""
    ref = copy.deepcopy(model)
    _disable_dropout(ref)
    try:
        ref64 = ref.double()
        a64, k64 = _map_tensors(_to_float64, (args, kwargs))
        return step(ref64, ref64, a64, k64), ""
    except Exception as e:  # some ops have no float64 kernel on CPU
        why = _one_line(e, 160)
        ref = copy.deepcopy(model).float()
        _disable_dropout(ref)
        a32, k32 = _map_tensors(lambda x: _clone(x).float() if x.is_floating_point() else x.clone(), (args, kwargs))
        return step(ref, ref, a32, k32), f"float64 reference failed ({why}); float32 reference used"


def _graph_name(label: str) -> str:
    """'graph3_backward' out of the collector's 'dynamo graph 4 (graph3_backward)'."""
    return label.rsplit("(", 1)[1].rstrip(")") if "(" in label else ""


def _find_unsupported(error: BaseException) -> NeuronUnsupportedOpError | None:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, NeuronUnsupportedOpError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _input_shapes(args: tuple, kwargs: dict) -> list[str]:
    leaves = pytree.tree_leaves((args, kwargs))
    return [describe_value(x) for x in leaves if isinstance(x, torch.Tensor)]


def evaluate(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    steps: int = 3,
    options: Mapping[str, Any] | None = None,
    progress: bool = True,
    phase_timeout: float | None = None,
) -> EvaluationReport:
    """Can ``model`` move to Trainium? Compile it with the neuron backend, run it, and report.

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or one tensor.
    A model in training mode with parameters that require grad runs forward + ``loss_fn(output)`` +
    backward (default loss: ``output.loss`` if present, else the sum of the floating outputs); otherwise
    inference under ``torch.no_grad()``. ``steps``: steady-state steps timed (medians). ``options``: the
    backend's options; without ``cache_dir`` (or ``cache=False``) a fresh temporary cache directory is
    used so that the cold compile is cold and the warm one a disk hit. ``progress``: phase lines on stderr.
    ``phase_timeout``: seconds each phase may take (main thread only; SIGALRM interrupts Python code, not a
    native call until it returns); a phase past it is an error of the report, and the later phases go on
    where they can.

    The model itself is not changed: every run uses a deep copy. This resets Dynamo
    (``torch._dynamo.reset()``) between phases, which drops other compiled functions of the process.
    """
    if steps < 1:
        raise ValueError(f"evaluate: steps={steps}; need at least 1 timed step")
    alarm = _PhaseAlarm(phase_timeout)
    args, kwargs = _split_inputs(example_inputs)
    user_options = dict(options or {})
    tmp_cache = None
    if "cache_dir" not in user_options and Options.from_user(user_options).cache:
        tmp_cache = tempfile.TemporaryDirectory(prefix="neuron-evaluate-cache-")
        user_options["cache_dir"] = tmp_cache.name
    opts = Options.from_user(user_options)
    training = model.training and any(p.requires_grad for p in model.parameters())
    step = _Step(training, loss_fn)
    report = EvaluationReport(
        model=type(model).__name__, mode="training" if training else "inference", target=opts.target
    )

    def say(msg: str) -> None:
        _progress(progress, msg)
        alarm.start(msg.split(" ", 1)[-1].split(":")[0] if msg[:1].isdigit() else msg)

    try:
        # AOTAutograd compiles a backward graph lazily, at the first backward call, outside the backend
        # call that could record its refusal and run the graph in eager: compile it with the forward here.
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            _run(model, args, kwargs, step, steps, user_options, report, say)
    except Exception as e:  # a failure in a later phase is a finding: the report keeps what was measured
        report.errors.append(f"{alarm.phase or 'evaluate'}: {_one_line(e)}")
    finally:
        alarm.stop()
        torch._dynamo.reset()
        if tmp_cache is not None:
            tmp_cache.cleanup()
    say("done: " + ("OK" if report.ok else "NOT OK"))
    return report


def _run(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    step: _Step,
    steps: int,
    options: dict[str, Any],
    report: EvaluationReport,
    say: Callable[[str], None],
) -> None:
    from ..cache import clear_memory

    say("1/6 graphs and graph breaks (torch._dynamo.explain)")
    try:
        report.dynamo_graphs, report.graph_breaks = _graph_breaks(copy.deepcopy(model), args, kwargs, step.training)
    except Exception as e:
        report.errors.append(f"explain: {_one_line(e)}")

    say(f"2/6 eager steps (1 + {steps} timed)")
    eager_model = copy.deepcopy(model)
    dropped = _disable_dropout(eager_model)
    try:
        eager, report.random_draws = random_draws(lambda: step(eager_model, eager_model, args, kwargs))
        if not step.training and (why := _no_tensor_returned(eager["outputs"]["output"])) is not None:
            raise NothingToJudge(why)
    except NothingToJudge as e:  # no compile either: nothing it gives could be judged
        report.nothing_to_judge = str(e)
        return
    except Exception as e:  # nothing to compare the compiled model with
        report.errors.append(f"eager step: {_one_line(e)} (the model fails without torch.compile; fix that first)")
        return

    report.timing["eager_step_ms"] = _median_ms(lambda: step(eager_model, eager_model, args, kwargs), steps)

    say("3/6 reference step (float64 copy of the model)")
    reference, ref_note = _reference_step(model, step, args, kwargs)

    say("4/6 cold compile: first compiled step with an empty cache")
    compiled_model = copy.deepcopy(model)
    _disable_dropout(compiled_model)
    collector = _CollectingBackend(options)
    torch._dynamo.reset()
    clear_memory()
    first = len(STATS.graphs)
    cmodel = torch.compile(compiled_model, backend=collector, dynamic=False)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always", NeuronFloat64Warning)
            t0 = time.perf_counter()
            compiled = step(cmodel, compiled_model, args, kwargs)
            report.timing["compile_cold_s"] = time.perf_counter() - t0
        for w in raised:
            if isinstance(w.message, NeuronFloat64Warning):
                name = str(w.message).split("'")[1] if "'" in str(w.message) else str(w.message)
                if name not in report.float64_downcasts:
                    report.float64_downcasts.append(name)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except Exception as e:
        refused = _find_unsupported(e)
        if refused is not None:
            collector.refused.append((refused.graph_name, list(refused.nodes)))
        else:
            report.errors.append(f"compiled step: {_one_line(e)}")
        report.unsupported = root_causes(collector.refused)
        report.errors += collector.errors
        return
    # a Dynamo graph refused in its backward had its forward compiled already; it runs in eager all the same
    refused = {name.split("_")[0] + "_" for _, nodes in collector.refused for name in [_graph_name(_)] if name}
    records = [r for r in STATS.graphs[first:] if not any(r.name.startswith(p) for p in refused)]
    report.graphs = [
        GraphEntry(
            r.name, r.kind, r.num_ops, r.nki_kernels, r.cache, r.lower_seconds, r.compile_seconds, r.hbm_peak, r.hbm_io
        )
        for r in records
    ]
    report.unsupported = root_causes(collector.refused)
    report.errors += collector.errors
    if not report.dynamo_graphs:
        report.dynamo_graphs = collector.dynamo_graphs

    say(f"5/6 steady compiled steps ({steps} timed)")
    before = collector.dynamo_graphs
    report.timing["step_ms"] = _median_ms(lambda: step(cmodel, compiled_model, args, kwargs), steps)
    report.timing["steps"] = steps
    report.recompiles = {
        "input_shapes": _input_shapes(args, kwargs),
        "compiled_graphs": collector.dynamo_graphs if not before else before,
        "aot_graphs": len(records),
        "recompiles_in_steps": collector.dynamo_graphs - before,
    }

    say("6/6 warm compile: Dynamo reset, compiled again from the disk cache")
    torch._dynamo.reset()
    clear_memory()
    warm_model = copy.deepcopy(model)
    _disable_dropout(warm_model)
    warm_first = len(STATS.graphs)
    warm_backend = _CollectingBackend(options)
    cwarm = torch.compile(warm_model, backend=warm_backend, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # already reported by the cold step
        t0 = time.perf_counter()
        step(cwarm, warm_model, args, kwargs)
        report.timing["compile_warm_s"] = time.perf_counter() - t0
    warm = STATS.graphs[warm_first:]
    report.timing["warm_cache_hits"] = sum(r.cache == "hit" for r in warm)
    report.timing["warm_graphs"] = len(warm)

    if report.random_draws:  # compiled and eager results differ by the draws themselves: nothing to judge
        return
    tol = DEFAULT_TOL.get(_run_dtype(model, args, kwargs), DEFAULT_TOL[torch.float32])
    outputs = compare_to_reference(reference["outputs"], eager["outputs"], compiled["outputs"], tol=tol)
    groups = [outputs]
    if step.training:
        groups.append(_compare_grads(reference["grads"], eager["grads"], compiled["grads"], tol))
    notes = [
        n for n in (ref_note, f"{dropped} dropout module(s) run at p=0 for the comparison" if dropped else "") if n
    ]
    report.numerics = merge(groups, note="; ".join(notes))


def _run_dtype(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.dtype:
    """The precision the model computes in: its least precise floating parameter, buffer or input.

    Every tensor is judged with this dtype's tolerance, as torch's checker takes it from the run: a float32
    loss computed from bfloat16 outputs is only as exact as they are."""
    floats = [t.dtype for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs)))
              if isinstance(t, torch.Tensor) and t.is_floating_point()]  # fmt: skip
    return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _compare_grads(reference: dict, eager: dict, compiled: dict, tol: float) -> NumericsVerdict:
    missing = sorted(set(eager) ^ set(compiled))
    verdict = compare_to_reference(
        {k: reference[k] for k in eager if k in compiled and k in reference},
        {k: eager[k] for k in eager if k in compiled and k in reference},
        {k: compiled[k] for k in eager if k in compiled and k in reference},
        tol=tol,
    )
    for name in missing:
        grad = compiled.get(name)
        if grad is not None and not grad.any():
            # A parameter used only for a graph output that the loss ignores: eager leaves its .grad None,
            # AOTAutograd's backward gets a zero cotangent for that output and returns a zero gradient
            # (aot_eager and Inductor too). The same update for every optimizer but weight decay's.
            dtype = str(grad.dtype).replace("torch.", "")
            verdict.tensors.append(TensorVerdict(
                name, True, dtype, list(grad.shape), None, None, None, None, None, passed_by="zero",
                why="eager leaves it None; AOTAutograd (Inductor too) gives a zero gradient when the loss does "
                    "not use a graph output",
            ))  # fmt: skip
            continue
        side = "compiled" if name in eager else "eager"
        verdict.tensors.append(TensorVerdict(name, False, "-", [], None, None, None, None, None,
                                             why=f"no gradient in the {side} run"))  # fmt: skip
        verdict.ok = False
    return verdict
