"""First-order rounding-error bounds of bfloat16 layers against float64: recurrent layers (LSTM, GRU, RNN) and a
convolution followed by a broadcast scale, forward and backward; and, at the end, the bound of a float8, bfloat16
or float16 result that is one rounding of a float32 computation (``assert_within_one_rounding``).

Why a derived bound and not eager's bits: eager's bfloat16 kernels are oneDNN's where oneDNN has bfloat16
(AVX-512, AVX512-BF16, AMX) and ATen's where it does not (AVX2-only CPUs). The LSTM: oneDNN computes the gates
in float32 and rounds c and h once a step, ATen rounds every gate op. A convolution's weight gradient: oneDNN
accumulates the whole batch in float32 and rounds once, ATen's slow convolution adds each sample's float32
product into the bfloat16 gradient (rounded at every sample). The orders differ by a few ulps (more where the
samples' terms cancel), so a test that copies one machine's eager values fails on the other (issue 52). Both,
and the compiled lowering, are judged here against the float64 result of the same bfloat16 inputs with a bound
from the computation's rounding-error analysis:

* **Sites.** ``recurrent_program`` recomputes the layer in float64 and marks every intermediate value that some
  implementation rounds (a *site*): the union of ATen's per-op order (each op's result rounded; the weight and
  bias gradients of a convolution rounded after each sample), oneDNN's (the LSTM's bias pair summed in the
  dtype, c and h rounded once a step) and the lowering's (oneDNN's for LSTM, torch's per-op decomposition for
  GRU/RNN). An implementation that does not round at a site only carries its float32 error there, which the
  site's radius includes, so one bound covers every order.
* **Radius of a site.** Rounding to bfloat16 (8 significand bits, to nearest): ``|d| <= u|v|``, u = 2^-8, plus
  the float32 arithmetic before it (2 u32, u32 = 2^-24). A float32 sigmoid/tanh is within 16 u32 (Sleef is
  within 1 ulp, XLA's rational tanh a few). A dot product of k bfloat16 products (exact in float32) accumulated
  in float32 in any order is within gamma_k = k u32 / (1 - k u32) of the sum of the absolute terms (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5); for the LSTM's gates k counts every
  term oneDNN accumulates (input, hidden, two biases), as its order sums them all in one accumulator.
* **Per element (worst case).** To first order the computed output is ``y_j + sum_k J_jk d_k`` with
  ``J_jk = dy_j/dv_k`` at the exact values, so ``|y^_j - y_j| <= sum_k |J_jk| r_k``. J is taken by autograd of
  the float64 program (a zero perturbation added at each site). The terms dropped are O(d^2): relative to the
  bound they are of the size of the relative errors themselves (below 1e-2 here).
* **In aggregate (torch's accuracy checker judges RMS error against float64).** With the standard probabilistic
  model of rounding (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019: the d_k mean-independent with mean 0),
  ``E[(y^_j - y_j)^2] = sum_k J_jk^2 E[d_k^2] <= sum_k J_jk^2 r_k^2 =: sigma_j^2``; so the RMS error over the
  elements is at most the RMS of sigma. (Errors uniform in [-r, r] would give sigma / sqrt(3): the check
  leaves that factor for fluctuation, and holds exactly in expectation for any distribution within the radii.)

A recurrent layer's outputs for one sequence do not depend on another sequence of the batch: one Jacobian row
serves the whole batch, so the rows are the outputs of one sequence (one batched backward pass over the float64
program). A convolution's weight gradient mixes the batch: there every output element is a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Unit roundoff of bfloat16 and float32 (round to nearest).
U_BF16 = 2.0**-8
U_F32 = 2.0**-24
#: A float32 sigmoid or tanh, relative to its value.
F32_ELEMENTARY = 16 * U_F32


def _gamma(k: int) -> float:
    return k * U_F32 / (1 - k * U_F32)


class Sites:
    """The rounding sites of a float64 program: each adds a zero perturbation (a leaf to differentiate by) and
    keeps the radius of the error an implementation may make there."""

    def __init__(self) -> None:
        self.perturbations: list[torch.Tensor] = []
        self.radii: list[torch.Tensor] = []

    def site(self, value: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
        perturbation = torch.zeros_like(value, requires_grad=True)
        self.perturbations.append(perturbation)
        self.radii.append(radius.detach().expand_as(value))
        return value + perturbation

    def rounded(self, value: torch.Tensor) -> torch.Tensor:
        """A float32 operation's result, rounded to bfloat16 (or not)."""
        return self.site(value, (U_BF16 + 2 * U_F32) * value.detach().abs())

    def elementary(self, value: torch.Tensor) -> torch.Tensor:
        """A float32 sigmoid/tanh, rounded to bfloat16 (or not)."""
        return self.site(value, (U_BF16 + F32_ELEMENTARY + U_F32) * value.detach().abs())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, terms: int) -> torch.Tensor:
        """``x @ weight.T + bias`` accumulated in float32 (``terms`` terms in the accumulator), rounded or not."""
        w = weight.double()
        y = x @ w.T
        magnitude = x.detach().abs() @ w.abs().T
        if bias is not None:
            y = y + bias.double()
            magnitude = magnitude + bias.double().abs()
        return self.site(y, _gamma(terms) * magnitude + (U_BF16 + U_F32) * y.detach().abs())


def _lstm_cell(s: Sites, x, h, c, w_ih, w_hh, b_ih, b_hh):
    terms = w_ih.shape[1] + w_hh.shape[1] + 2
    gates = s.rounded(s.linear(x, w_ih, b_ih, terms) + s.linear(h, w_hh, b_hh, terms))  # ATen's order
    if b_ih is not None:  # oneDNN's and the lowering's: the bias pair summed in the dtype first
        gates = s.site(gates, U_BF16 * (b_ih.double() + b_hh.double()).abs())
    i, f, g, o = gates.chunk(4, -1)
    i, f, g, o = s.elementary(i.sigmoid()), s.elementary(f.sigmoid()), s.elementary(g.tanh()), s.elementary(o.sigmoid())
    c = s.rounded(s.rounded(f * c) + s.rounded(i * g))
    return s.rounded(o * s.elementary(c.tanh())), c


def _gru_cell(s: Sites, x, h, c, w_ih, w_hh, b_ih, b_hh):
    xr, xz, xn = s.linear(x, w_ih, b_ih, w_ih.shape[1] + 1).chunk(3, -1)
    hr, hz, hn = s.linear(h, w_hh, b_hh, w_hh.shape[1] + 1).chunk(3, -1)
    r = s.elementary(s.rounded(xr + hr).sigmoid())
    z = s.elementary(s.rounded(xz + hz).sigmoid())
    n = s.elementary(s.rounded(xn + s.rounded(r * hn)).tanh())
    return s.rounded(s.rounded(s.rounded(h - n) * z) + n), None  # torch's (h - n) * z + n, eager's and ours


def _rnn_tanh_cell(s: Sites, x, h, c, w_ih, w_hh, b_ih, b_hh):
    pre = s.rounded(s.linear(x, w_ih, b_ih, w_ih.shape[1] + 1) + s.linear(h, w_hh, b_hh, w_hh.shape[1] + 1))
    return s.elementary(pre.tanh()), None


def recurrent_program(module: torch.nn.RNNBase, x: torch.Tensor, s: Sites) -> dict[str, torch.Tensor]:
    """``module(x)`` (zero initial state) in float64 with its rounding sites marked, batch first:
    {"output": (B, T, D*H), "h_n": (B, L*D, H)[, "c_n"]}."""
    cell = {"LSTM": _lstm_cell, "GRU": _gru_cell, "RNN_TANH": _rnn_tanh_cell}[module.mode]
    assert not module.proj_size and not (module.dropout and module.training), module
    seq = (x if module.batch_first else x.transpose(0, 1)).double()
    batch, steps = seq.shape[:2]
    directions = 2 if module.bidirectional else 1
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            w_ih, w_hh = getattr(module, "weight_ih" + suffix), getattr(module, "weight_hh" + suffix)
            b_ih, b_hh = (getattr(module, f"bias_{n}{suffix}") if module.bias else None for n in ("ih", "hh"))
            h = c = torch.zeros(batch, module.hidden_size, dtype=torch.float64)
            out: list[torch.Tensor] = [h] * steps
            for t in range(steps - 1, -1, -1) if direction else range(steps):
                h, c = cell(s, seq[:, t], h, c, w_ih, w_hh, b_ih, b_hh)
                out[t] = h
            outputs.append(torch.stack(out, 1))
            h_n.append(h)
            c_n.append(c)
        seq = torch.cat(outputs, -1)
    result = {"output": seq, "h_n": torch.stack(h_n, 1)}
    if module.mode == "LSTM":
        result["c_n"] = torch.stack(c_n, 1)
    return result


@dataclass
class Bound:
    """Per element: the first-order worst case and the RMS scale sigma (see the module's docstring)."""

    worst: torch.Tensor
    sigma: torch.Tensor


def first_order_bounds(outputs: dict[str, torch.Tensor], s: Sites, per_sequence: bool = True) -> dict[str, Bound]:
    """The bound of every output element. ``per_sequence``: the outputs are batch first and no sequence's depend
    on another's, so row j of the Jacobian serves every sequence; else every output element is a row."""
    batch = next(iter(outputs.values())).shape[0] if per_sequence else 1
    flat = torch.cat([o.reshape(batch, -1) for o in outputs.values()], 1)  # (batch, rows)
    rows = flat.shape[1]
    cotangents = torch.eye(rows, dtype=torch.float64).unsqueeze(1).expand(rows, batch, rows)
    grads = torch.autograd.grad(flat, s.perturbations, cotangents, is_grads_batched=True, allow_unused=True)
    worst = torch.zeros(rows, batch, dtype=torch.float64)
    square = torch.zeros(rows, batch, dtype=torch.float64)
    for g, radius in zip(grads, s.radii):
        if g is not None:
            contribution = (g * radius).reshape(rows, batch, -1)
            worst += contribution.abs().sum(-1)
            square += contribution.square().sum(-1)
    bounds, start = {}, 0
    for name, o in outputs.items():
        n = o.numel() // batch
        worst_o, sigma_o = (t[start : start + n].T.reshape(o.shape) for t in (worst, square.sqrt()))
        bounds[name] = Bound(worst_o, sigma_o)
        start += n
    return bounds


def recurrent_bounds(module: torch.nn.RNNBase, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Bound]]:
    """The float64 result of ``module(x)`` (bfloat16 module and input, zero initial state) and its bounds, in
    the module's own layout (h_n/c_n layers first; output batch first if the module is)."""
    s = Sites()
    outputs = recurrent_program(module, x, s)
    bounds = first_order_bounds(outputs, s)

    def layout(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1) if name != "output" or not module.batch_first else t

    values = {n: layout(n, o.detach()) for n, o in outputs.items()}
    return values, {n: Bound(layout(n, b.worst), layout(n, b.sigma)) for n, b in bounds.items()}


def _accumulated(s: Sites, parts: list[torch.Tensor], magnitude: torch.Tensor, terms: int) -> torch.Tensor:
    """The sum of per-sample ``parts`` (each a float32 sum), as ATen's slow convolution adds them into a
    bfloat16 gradient (rounded after each) or oneDNN in one float32 accumulator of ``terms`` terms whose
    absolute values sum to ``magnitude`` (rounded once)."""
    total = parts[0]
    for part in parts[1:]:
        total = s.rounded(total) + part
    return s.site(total, _gamma(terms) * magnitude + (U_BF16 + U_F32) * total.detach().abs())


def conv_scale_program(
    conv: torch.nn.Conv2d, scale: torch.Tensor, x: torch.Tensor, cotangent: torch.Tensor, s: Sites
) -> dict[str, torch.Tensor]:
    """``conv(x) * scale + 1`` and its gradients for ``cotangent`` (of the input, weight, bias and scale) in
    float64 with their rounding sites marked."""
    assert conv.bias is not None and conv.groups == 1 and isinstance(conv.padding, tuple), conv
    w, b, sc, x, g = (t.detach().double() for t in (conv.weight, conv.bias, scale, x, cotangent))
    kw = {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}
    y = F.conv2d(x, w, b, **kw)
    y = s.site(y, _gamma(w[0].numel() + 1) * F.conv2d(x.abs(), w.abs(), b.abs(), **kw) + (U_BF16 + U_F32) * y.abs())
    out = s.rounded(s.rounded(y * sc) + 1)
    g_y = s.rounded(g * sc)
    per_sample = g_y.shape[0] * g_y[0, 0].numel()  # the terms of a weight or bias gradient element
    grad_x = torch.nn.grad.conv2d_input(x.shape, w, g_y, **kw)
    magnitude = torch.nn.grad.conv2d_input(x.shape, w.abs(), g_y.detach().abs(), **kw)
    grad_x = s.site(grad_x, _gamma(w.shape[0] * w[0, 0].numel()) * magnitude + (U_BF16 + U_F32) * grad_x.abs())
    grad_w = _accumulated(
        s,
        [torch.nn.grad.conv2d_weight(x[n : n + 1], w.shape, g_y[n : n + 1], **kw) for n in range(len(x))],
        torch.nn.grad.conv2d_weight(x.abs(), w.shape, g_y.detach().abs(), **kw),
        per_sample,
    )
    grad_b = _accumulated(s, [part.sum((1, 2)) for part in g_y], g_y.detach().abs().sum((0, 2, 3)), per_sample)
    product = s.rounded(g * y)
    grad_scale = product.sum((0, 2, 3)).reshape(sc.shape)
    magnitude = product.detach().abs().sum((0, 2, 3)).reshape(sc.shape)
    grad_scale = s.site(grad_scale, _gamma(per_sample) * magnitude + (U_BF16 + U_F32) * grad_scale.abs())
    return {"output": out, "grad of input": grad_x, "grad of weight": grad_w, "grad of bias": grad_b,
            "grad of scale": grad_scale}  # fmt: skip


def conv_scale_bounds(
    conv: torch.nn.Conv2d, scale: torch.Tensor, x: torch.Tensor, cotangent: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, Bound]]:
    """The float64 values of ``conv_scale_program`` and their bounds."""
    s = Sites()
    outputs = conv_scale_program(conv, scale, x, cotangent, s)
    return {n: o.detach() for n, o in outputs.items()}, first_order_bounds(outputs, s, per_sequence=False)


def assert_within_bound(actual: torch.Tensor, reference: torch.Tensor, bound: Bound, what: str) -> None:
    """Per element within the first-order worst case, and RMS error within the RMS of sigma."""
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    err = (actual.double() - reference).abs()
    bad = ~(err <= bound.worst)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} element(s) outside the first-order rounding bound, e.g. {actual[bad][0].item()!r}"
        f" where float64 gives {reference[bad][0].item()!r} (error {err[bad][0].item():.3g} > bound "
        f"{bound.worst[bad][0].item():.3g})"
    )
    rms, rms_sigma = err.square().mean().sqrt().item(), bound.sigma.square().mean().sqrt().item()
    assert rms <= rms_sigma, f"{what}: RMS error vs float64 {rms:.3g} > RMS of the rounding scale sigma {rms_sigma:.3g}"


# ---- 8- and 16-bit results: one rounding of float64 (issue 56) -----------------------------------------------
# A float8/bfloat16/float16 result is judged by where it sits on its dtype's grid, not by one CPU's eager bits.
# Eager's ``_scaled_mm`` to float8 (tensorwise scales) is oneDNN's matmul on AMX CPUs (ATen at AVX-512), which
# rounds the float32 result to float16 and then to float8 (6.7493 -> 6.75 -> 7.0 where one rounding gives 6.5),
# and ATen's float32 product rounded once elsewhere (and in the lowering); eager's addcmul/lerp fuse their multiply
# and add where ATen's kernels have FMA (AVX2, AVX-512) and round twice in float32 where they do not (ATen's
# default kernels). Any implementation that computes in float32 (or float16, whose grid holds every float8 value)
# within ``slack`` of the exact result and then rounds lands between the dtype's values at or below
# ``reference - slack`` and at or above ``reference + slack``: with a slack far below half an ulp, one of the two
# values bracketing the reference, an error below one ulp at the reference's magnitude. Rounded to nearest, it is
# also the nearer of the two wherever the reference is further than the slack from their midpoint.


def float32_accumulation_error(terms: int, magnitude: torch.Tensor) -> torch.Tensor:
    """A bound of the error of a float32 computation with at most ``terms`` roundings on any path (a dot product
    of k terms: k, in any order), whose terms' absolute values sum to ``magnitude``: gamma_terms * magnitude
    (Higham, eq. 3.5, as ``Sites.linear``)."""
    return _gamma(terms) * magnitude


def _codes(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit float ``dtype``, as that dtype."""
    bits = 8 * dtype.itemsize
    assert dtype.is_floating_point and bits in (8, 16), f"{dtype}: not an 8- or 16-bit float dtype"
    signed = torch.int8 if bits == 8 else torch.int16
    return torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1), dtype=torch.int32).to(signed).view(dtype)


def grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8- or 16-bit float ``dtype``, ascending, as float64 (-0 and 0 are one)."""
    values = _codes(dtype).double()
    return values[values.isfinite()].unique()


def overflow(dtype: torch.dtype) -> float:
    """What a conversion to ``dtype`` gives past its largest finite value without saturating: inf where the format
    has one, else NaN (float8_e4m3fn has no inf: torch's ``.to()`` saturates it to 448, XLA's convert and eager's
    oneDNN ``_scaled_mm`` give NaN)."""
    return math.inf if bool(_codes(dtype).double().isinf().any()) else math.nan


def bracket(reference: torch.Tensor, dtype: torch.dtype, slack: torch.Tensor | float = 0.0):
    """Per element of the float64 ``reference``: the largest ``dtype`` value at or below ``reference - slack`` and
    the smallest at or above ``reference + slack`` (with no slack: the two values around the reference, or itself
    twice if it is one). Past the largest finite value M: M, or ``overflow`` beyond it (saturation gives M, a plain
    conversion the overflow)."""
    assert reference.dtype == torch.float64 and bool(reference.isfinite().all()), "a finite float64 reference"
    values, r = grid(dtype), reference.contiguous()
    last, beyond = len(values) - 1, torch.full_like(r, overflow(dtype))
    below = torch.searchsorted(values, (r - slack).contiguous(), right=True) - 1  # -1: below the smallest value
    above = torch.searchsorted(values, (r + slack).contiguous(), right=False)  # len: above the largest
    lo = torch.where(below >= 0, values[below.clamp(0, last)], -beyond)
    hi = torch.where(above <= last, values[above.clamp(0, last)], beyond)
    return lo, hi


def assert_within_one_rounding(
    actual: torch.Tensor,
    reference: torch.Tensor,
    what: str,
    slack: torch.Tensor | float = 0.0,
    nearest_beyond: torch.Tensor | float | None = None,
) -> None:
    """Every element of the 8- or 16-bit float ``actual`` lies within ``bracket(reference, slack)``: one rounding
    of a value within ``slack`` (the computation's own error before its rounding, per element or one for all) of
    the float64 ``reference``. With ``nearest_beyond`` (such an error bound), also the ``dtype`` value nearest the
    reference, ties to even, wherever the reference is further than that from the midpoint of its two neighbours:
    rounded once, to nearest, as IEEE conversion does."""
    dtype = actual.dtype
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    a = actual.double()
    lo, hi = bracket(reference, dtype, slack)
    open_end = lo.isnan() | hi.isnan()  # past the largest finite value of a dtype without inf
    ok = torch.where(a.isnan(), open_end, ((a >= lo) | lo.isnan()) & ((a <= hi) | hi.isnan()))
    assert ok.all(), (
        f"{what}: {int((~ok).sum())} of {a.numel()} element(s) outside one rounding of float64, e.g. "
        f"{a[~ok][0].item()!r} where float64 gives {reference[~ok][0].item()!r} (allowed [{lo[~ok][0].item()!r}, "
        f"{hi[~ok][0].item()!r}])"
    )
    if nearest_beyond is None:
        return
    lo, hi = bracket(reference, dtype)
    to_lo, to_hi = reference - lo, hi - reference
    lo_even = lo.nan_to_num(0.0).to(dtype).view(torch.int8 if dtype.itemsize == 1 else torch.int16) % 2 == 0
    nearest = torch.where(to_lo < to_hi, lo, torch.where(to_hi < to_lo, hi, torch.where(lo_even, lo, hi)))
    decided = lo.isfinite() & hi.isfinite() & ((to_lo - to_hi).abs() > 2 * torch.as_tensor(nearest_beyond))
    wrong = decided & (a != nearest)
    assert not wrong.any(), (
        f"{what}: {int(wrong.sum())} element(s) not rounded to nearest, e.g. {a[wrong][0].item()!r} where float64 "
        f"gives {reference[wrong][0].item()!r} (nearest {nearest[wrong][0].item()!r})"
    )
