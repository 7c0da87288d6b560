"""Conformance of the emulator to NKI 0.8 (Neuron 2.34) and to the releases before it under the version setting
(``nki.simulate(kernel, nki_version=...)`` / ``NEURON_COMPILE_NKI_VERSION``; emulator/versions.py): each 0.8 change
with its 0.8 behaviour and its 0.7 (or 0.6) behaviour, the ``nki.lnc`` cross-core calls of an LNC-2 launch against
NumPy, and the deadlock a mismatched barrier causes.

Kernels here are written for this suite from the NKI docs (the nki.lnc pages, the 0.8 deprecation announcement,
the local_gather reference), not copied from AWS's code.
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import numpy as np
import pytest

from neuron_compile import nki
from neuron_compile.kernels.emulator import versions

nl, nisa, lnc = nki.language, nki.isa, nki.lnc
rng = np.random.default_rng(50)


def _rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def _run(kernel, *args, version=None, lnc_degree=None):
    """Run ``kernel`` under NKI ``version``; returns (outputs, warnings raised while it ran)."""
    k = kernel[lnc_degree] if lnc_degree else kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nki.simulate(k, nki_version=version)(*args)
    return out, [w for w in caught if issubclass(w.category, (DeprecationWarning, nki.NkiWarning))]


def _halves(x):
    rows = x.shape[0] // 2
    p = nl.program_id(axis=0)
    return x[p * rows : (p + 1) * rows], p, rows


# ----------------------------------------------------------------------------------- the version setting
def test_version_setting(monkeypatch) -> None:
    @nki.jit
    def kern(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.load(x)
        nisa.dma_copy(out, t)
        return out

    x = _rand(4, 4)
    _, st = nki.simulate(kern, stats=True)(x)
    assert nki.last_run_stats() is st
    monkeypatch.setenv(versions.VERSION_ENV, "0.7.0")
    assert versions.version_default() == "0.7"
    monkeypatch.setenv(versions.VERSION_ENV, "0.9")
    with pytest.raises(nki.NkiError, match=r"NEURON_COMPILE_NKI_VERSION='0.9'.*0\.6.*0\.7.*0\.8"):
        nki.simulate(kern)(x)
    monkeypatch.delenv(versions.VERSION_ENV)
    assert versions.version_default() == "0.8"
    with pytest.raises(nki.NkiError, match="nki_version='1.0'"):
        nki.simulate(kern, nki_version="1.0")(x)


# --------------------------------------------------------------------------------------------- nki.lnc
@nki.jit
def swap_halves(x, via_isa=False):
    """Each core loads its half of x and receives the other core's half: out = x with its halves swapped."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine, p, rows = _halves(x)
    t = nl.load(mine)
    got = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    if via_isa:
        nisa.sendrecv(t, got, send_to_rank=1 - p, recv_from_rank=1 - p, pipe_id=0)
    else:
        lnc.sendrecv(src=t, dst=got, send_to_rank=1 - p, recv_from_rank=1 - p)
    nl.store(out[p * rows : (p + 1) * rows], got)
    return out


@nki.jit
def reduce_halves(x, op, via_isa=False):
    """out[half p] = op(x[half p], x[other half]) via sendrecv_compute."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine, p, rows = _halves(x)
    t = nl.load(mine)
    got = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    call = nisa.sendrecv_compute if via_isa else lnc.sendrecv_compute
    call(t, got, 1 - p, 1 - p, op)
    nl.store(out[p * rows : (p + 1) * rows], got)
    return out


@nki.jit
def add_after_barrier(x, via_isa=False):
    """Both cores write their half of a shared scratch tensor, meet at a barrier, then add the other core's half
    to theirs into ``out`` (writing back into the scratch would race with the peer's read)."""
    scratch = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine, p, rows = _halves(x)
    t = nl.load(mine)
    nl.store(scratch[p * rows : (p + 1) * rows], t)
    (nisa.core_barrier if via_isa else lnc.core_barrier)(scratch, (0, 1))
    other = nl.load(scratch[(1 - p) * rows : (2 - p) * rows])
    nl.store(out[p * rows : (p + 1) * rows], nl.add(t, other))
    return out


def _swapped(x):
    h = x.shape[0] // 2
    return np.concatenate([x[h:], x[:h]])


LNC_CASES = {
    "sendrecv": (lambda x, isa: (swap_halves, (x, isa)), _swapped),
    "sendrecv_compute": (lambda x, isa: (reduce_halves, (x, nl.maximum, isa)), lambda x: np.maximum(x, _swapped(x))),
    "core_barrier": (lambda x, isa: (add_after_barrier, (x, isa)), lambda x: x + _swapped(x)),
}


@pytest.mark.parametrize("api", list(LNC_CASES))
def test_lnc_api_matches_numpy_under_0_8_and_is_absent_in_0_7(api) -> None:
    make, expect = LNC_CASES[api]
    x = _rand(16, 8)
    kern, args = make(x, False)
    out, warned = _run(kern, *args, lnc_degree=2)
    np.testing.assert_array_equal(out, expect(x))
    assert not warned
    with pytest.raises(nki.NkiVersionError, match=rf"nki\.lnc\.{api} is new in NKI 0\.8.*enforces NKI 0\.7"):
        _run(kern, *args, version="0.7", lnc_degree=2)


@pytest.mark.parametrize("api", list(LNC_CASES))
def test_isa_lnc_wrappers_deprecated_in_0_8_silent_in_0_7(api) -> None:
    make, expect = LNC_CASES[api]
    x = _rand(16, 8)
    kern, args = make(x, True)
    out, warned = _run(kern, *args, lnc_degree=2)
    np.testing.assert_array_equal(out, expect(x))
    assert len(warned) == 1 and warned[0].category is DeprecationWarning, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    assert f"nki.isa.{api} is deprecated in NKI 0.8" in msg and f"nki.lnc.{api}" in msg
    assert warned[0].filename == __file__  # at the kernel's line, not inside the emulator
    out7, warned7 = _run(kern, *args, version="0.7", lnc_degree=2)
    np.testing.assert_array_equal(out7, expect(x))
    assert not warned7


def test_sendrecv_compute_add_and_rules() -> None:
    x = _rand(16, 8)
    out, _ = _run(reduce_halves, x, nl.add, lnc_degree=2)
    np.testing.assert_allclose(out, x + _swapped(x), rtol=1e-6)
    with pytest.raises(nki.NkiValidationError, match="reduce_op 'multiply'"):
        _run(reduce_halves, x, nl.multiply, lnc_degree=2)
    with pytest.raises(nki.NkiValidationError, match=r"needs an LNC-2 launch \(kernel\[2\]"):
        _run(swap_halves, x)  # one program: no peer to exchange with
    with pytest.raises(nki.NkiUnsupportedError, match="LNC 1"):
        _run(add_after_barrier, x)


def test_barrier_orders_the_peers_writes_in_the_cost_model() -> None:
    """After the barrier a core's read of ``out`` waits for the other core's store: the launch's critical path
    covers both stores, the barrier and the dependent reads."""
    x = _rand(256, 512)
    _, st = nki.simulate(add_after_barrier[2], stats=True)(x)
    _, st_plain = nki.simulate(swap_halves[2], stats=True)(x)
    spans = [p["makespan"] for p in st.schedule]
    assert len(spans) == 2 and spans[0] == pytest.approx(spans[1], rel=0.05)
    assert min(spans) > 3 * 1.3e-6  # load, store, then (after the barrier) load and store: >= 4 DMA latencies
    assert st_plain.schedule[0]["makespan"] < min(spans)


# -------------------------------------------------------------------------------------------- deadlocks
@nki.jit
def barrier_on_core0_only(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine, p, rows = _halves(x)
    nl.store(out[p * rows : (p + 1) * rows], nl.load(mine))
    if nl.program_id(axis=0) == 0:
        lnc.core_barrier(out, (0, 1))  # BARRIER-CORE0
    return out


@nki.jit
def barrier_meets_sendrecv(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine, p, rows = _halves(x)
    t = nl.load(mine)
    if p == 0:
        lnc.core_barrier(out, (0, 1))  # MISMATCH-BARRIER
    else:
        lnc.sendrecv(t, t, 0, 0)  # MISMATCH-SENDRECV
    nl.store(out[p * rows : (p + 1) * rows], t)
    return out


def _line(tag: str) -> int:
    src = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(src) if line.rstrip().endswith(f"# {tag}"))


def test_lnc2_barrier_deadlock_names_both_call_sites() -> None:
    x = _rand(16, 8)
    with pytest.raises(nki.NkiDeadlockError) as err:
        nki.simulate(barrier_on_core0_only[2])(x)
    msg = str(err.value)
    assert f"{__file__}:{_line('BARRIER-CORE0')} (barrier_on_core0_only)" in msg  # program 0's barrier
    def_line = barrier_on_core0_only.fn.__code__.co_firstlineno
    assert re.search(rf"program 1 returned from .*{re.escape(__file__)}:{def_line}", msg)  # program 1's exit
    with pytest.raises(nki.NkiDeadlockError) as err:
        nki.simulate(barrier_meets_sendrecv[2])(x)
    msg = str(err.value)
    assert f":{_line('MISMATCH-BARRIER')} " in msg and f":{_line('MISMATCH-SENDRECV')} " in msg
    assert "nki.lnc.core_barrier" in msg and "nki.lnc.sendrecv" in msg


# ------------------------------------------------------------------------------- registers and scalars
@nki.jit
def count_with_registers(n):
    """out = n + 2, through the 0.6 virtual registers."""
    out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(t, n)
    r = nisa.register_alloc(0)
    nisa.register_load(r, t)
    s = nisa.register_alloc()
    nisa.register_move(s, r + 2)
    assert isinstance(s, nisa.VirtualRegister)
    nisa.register_store(t, s)
    nisa.dma_copy(out, t)
    return out


@nki.jit
def count_with_scalars(n):
    """out = n + 2, through NkiScalar (0.7)."""
    out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(t, n)
    s = nisa.scalar_load(t) + 2
    nisa.scalar_store(t, s)
    nisa.dma_copy(out, t)
    return out


def test_registers_deprecated_in_0_8_for_scalar_load_store() -> None:
    n = np.array([[40]], np.int32)
    out, warned = _run(count_with_registers, n)
    assert out[0, 0] == 42
    by_api = {re.match(r"(\S+) is deprecated", str(w.message)).group(1): str(w.message) for w in warned}
    assert sorted(by_api) == [
        "nki.isa.VirtualRegister",
        "nki.isa.register_alloc",
        "nki.isa.register_load",
        "nki.isa.register_move",
        "nki.isa.register_store",
    ]
    assert len(warned) == 6  # one per call site: register_alloc has two
    assert all("scalar_load" in m or "scalar_store" in m or "NkiScalar" in m for m in by_api.values())
    out7, warned7 = _run(count_with_registers, n, version="0.7")
    assert out7[0, 0] == 42 and not warned7


def test_scalar_load_store_0_7_on_and_refused_by_0_6() -> None:
    n = np.array([[40]], np.int32)
    for v in ("0.7", "0.8"):
        out, warned = _run(count_with_scalars, n, version=v)
        assert out[0, 0] == 42 and not warned
    with pytest.raises(nki.NkiVersionError, match=r"nki\.isa\.scalar_load is new in NKI 0\.7"):
        _run(count_with_scalars, n, version="0.6")


# --------------------------------------------------------------------------------------------- gathers
def _local_gather_reference(src, index, n_elem, n_valid):
    """The documented NumPy semantics: per 16-partition GpSimd core, the core's indices flattened partition-first
    select groups of ``n_elem`` elements of each of its partitions (index = element offset)."""
    out = np.empty((src.shape[0], n_valid, n_elem), src.dtype)
    for c in range(0, src.shape[0], 16):
        idx = index[c : c + 16].flatten(order="F")[:n_valid] // n_elem
        out[c : c + 16] = np.take(src[c : c + 16].reshape(16, -1, n_elem), idx, axis=1)
    return out.reshape(src.shape[0], -1)


@nki.jit
def gather(src, index, n_elem, n_valid):
    n_idx = index.shape[1] * 16 if n_valid is None else n_valid
    out = nl.ndarray((src.shape[0], n_idx * n_elem), src.dtype, buffer=nl.shared_hbm)
    s, i = nl.load(src), nl.load(index)
    d = nl.ndarray(out.shape, src.dtype, buffer=nl.sbuf)
    if n_valid is None:
        nisa.local_gather(d, s, i, num_elem_per_idx=n_elem)
    else:
        nisa.local_gather(d, s, i, num_elem_per_idx=n_elem, num_valid_indices=n_valid)
    nl.store(out, d)
    return out


def test_local_gather_num_valid_indices() -> None:
    src = _rand(32, 64)
    per_core = rng.integers(0, 16, size=(16, 3)).astype(np.uint16) * 4  # element offsets of 4-element groups
    index = np.tile(per_core, (2, 1))
    out, warned = _run(gather, src, index, 4, 40)
    np.testing.assert_array_equal(out, _local_gather_reference(src, index, 4, 40))
    assert not warned
    out, warned = _run(gather, src, index, 4, None)  # 0.8: warns (result undefined), gathers all 48
    np.testing.assert_array_equal(out, _local_gather_reference(src, index, 4, 48))
    assert len(warned) == 1 and issubclass(warned[0].category, nki.NkiWarning)
    assert "num_valid_indices" in str(warned[0].message) and "undefined" in str(warned[0].message)
    _, warned7 = _run(gather, src, index, 4, None, version="0.7")
    assert not warned7
    with pytest.raises(nki.NkiValidationError, match="uint16"):
        _run(gather, src, index.astype(np.int32), 4, 40)


# ------------------------------------------------------------------------------------ bit-vector engines
def _bitvec(op_call):
    @nki.jit
    def kern(a, b):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        x, y = nl.load(a), nl.load(b)
        d = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        op_call(d, x, y)
        nl.store(out, d)
        return out

    return kern


BITVEC = {
    "tensor_tensor_gpsimd": (
        lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.bitwise_and, engine=nisa.engine.gpsimd),
        lambda a, b: a & b,
    ),
    "tensor_scalar_scalar_engine": (
        lambda d, x, y: nisa.tensor_scalar(d, x, nl.bitwise_xor, 0x0F0F, engine=nisa.engine.scalar),
        lambda a, b: a ^ 0x0F0F,
    ),
    "tensor_scalar_gpsimd": (
        lambda d, x, y: nisa.tensor_scalar(d, x, nl.left_shift, 3, engine=nisa.engine.gpsimd),
        lambda a, b: a << 3,
    ),
}


@pytest.mark.parametrize("case", list(BITVEC))
def test_bitvec_operators_vector_only_from_0_8(case) -> None:
    call, expect = BITVEC[case]
    a = rng.integers(0, 1 << 12, size=(8, 16)).astype(np.int32)
    b = rng.integers(0, 1 << 12, size=(8, 16)).astype(np.int32)
    with pytest.raises(nki.NkiValidationError, match=r"bit-vector operators run on the\s+Vector engine only"):
        _run(_bitvec(call), a, b)
    out7, _ = _run(_bitvec(call), a, b, version="0.7")
    np.testing.assert_array_equal(out7, expect(a, b))


def test_bitvec_operator_defaults_to_vector_on_int32() -> None:
    a = rng.integers(0, 1 << 12, size=(8, 16)).astype(np.int32)
    kern = _bitvec(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.bitwise_or))
    out, st = nki.simulate(kern, stats=True)(a, a[::-1].copy())
    np.testing.assert_array_equal(out, a | a[::-1])
    assert st.engines["vector"].instructions == 1 and st.engines["gpsimd"].instructions == 0


# --------------------------------------------------------------------------- the legacy namespace, loops
def test_import_neuronxcc_nki_gives_the_migration_error(monkeypatch) -> None:
    with pytest.raises(ModuleNotFoundError, match=r"removed from neuronx-cc in Neuron 2\.34.*import nki"):
        import neuronxcc.nki.language
    with pytest.raises(ModuleNotFoundError, match=r"removed from neuronx-cc in Neuron 2\.34"):
        from neuronxcc import nki as _  # noqa: F401
    monkeypatch.setenv(versions.VERSION_ENV, "0.7")
    with pytest.raises(ModuleNotFoundError, match=r"legacy NKI namespace: Neuron 2\.33 \(NKI 0\.7\) still ships it"):
        import neuronxcc.nki
    assert importlib.util.find_spec("neuronxcc") is None  # other lookups see what is installed
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'neuronxcc'$"):
        import neuronxcc  # noqa: F401


@nki.jit
def sum_rows_dynamic(x, n):
    """Sum of the first n rows of x with NKI 0.6's run-time loop."""
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    acc = nl.zeros((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    row = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(cnt, n)
    reg = nisa.register_alloc()
    nisa.register_load(reg, cnt)
    for i in nl.dynamic_range(reg):
        nisa.dma_copy(row, x.ap([[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=i, indirect_dim=0))
        nisa.tensor_tensor(acc, acc, row, nl.add)
    nisa.dma_copy(out, acc)
    return out


def test_dynamic_range_is_0_6_only_and_grids_0_7_on() -> None:
    x, n = _rand(6, 4), np.array([[3]], np.int32)
    out, warned = _run(sum_rows_dynamic, x, n, version="0.6")
    np.testing.assert_allclose(out, x[:3].sum(0, keepdims=True), rtol=1e-6)
    assert [str(w.message).split(" is ")[0] for w in warned] == ["nki.language.dynamic_range"]  # registers: 0.8
    for v in ("0.7", "0.8"):
        with pytest.raises(nki.NkiVersionError, match=r"dynamic_range was removed in NKI 0\.7.*nl\.fori_loop"):
            _run(sum_rows_dynamic, x, n, version=v)

    @nki.jit
    def tiled(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.load(nl.tiles(x, tile_shape=(6, 4))[0, 0].data)
        nl.store(out, t)
        return out

    np.testing.assert_array_equal(_run(tiled, x, version="0.7")[0], x)
    with pytest.raises(nki.NkiVersionError, match=r"nki\.language\.tiles is new in NKI 0\.7"):
        _run(tiled, x, version="0.6")
