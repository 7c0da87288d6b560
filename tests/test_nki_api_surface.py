"""The documented NKI API in the emulator (issue 40): the generated coverage table in docs/nki.md is current,
no documented entry is missing, every entry AWS's tutorials use is implemented, refused entries raise
NkiUnsupportedError naming themselves, and the semantics of what was added (access patterns, view methods,
broadcast_to, tensor_tensor_scan, run-time loops and scalars, tile/block grids, LNC launches, the documented
keyword names, generation rules) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from neuron_compile import nki
from neuron_compile.kernels.emulator import api_surface
from neuron_compile.kernels.emulator.errors import NkiUnsupportedError
from tools import gen_nki_api_table

nl, nisa = nki.language, nki.isa
rng = np.random.default_rng(1)
STATES = api_surface.api_states()


def _rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_api_table_is_current() -> None:
    """docs/nki.md's API table matches api_surface (regenerate: python -m tools.gen_nki_api_table)."""
    text = gen_nki_api_table.DOC.read_text()
    assert gen_nki_api_table.render(text) == text, "run `python -m tools.gen_nki_api_table`"


def test_no_documented_entry_missing() -> None:
    missing = [f"{s.module}.{s.name}: {s.note}" for s in STATES if s.state == "missing"]
    assert not missing, "documented NKI entries neither implemented nor refused:\n" + "\n".join(missing)


def test_tutorial_entries_implemented() -> None:
    by = {(s.module, s.name): s.state for s in STATES}
    mods = {"language": "nki.language", "isa": "nki.isa", "tile_size": "nki.language.tile_size", "tensor": "NkiTensor"}
    bad = [
        f"{mods[k]}.{n}: {by.get((mods[k], n))}"
        for k, names in api_surface.TUTORIAL_NAMES.items()
        for n in names
        if by.get((mods[k], n)) != "implemented"
    ]
    assert not bad, bad


@pytest.mark.parametrize(
    "entry",
    [s for s in STATES if s.state == "refused" and s.module in ("nki.isa", "nki.language")],
    ids=lambda s: f"{s.module}.{s.name}",
)
def test_refused_entry_raises_naming_itself(entry) -> None:
    fn = getattr(nisa if entry.module == "nki.isa" else nl, entry.name)
    with pytest.raises(NkiUnsupportedError, match=entry.name):
        fn(None)


# ------------------------------------------------------------------------------------------- semantics
def _run(body, *arrays, target=None):
    """Run ``body(*hbm_args) -> (sbuf tile)`` as a kernel and return the tile's contents."""

    @nki.jit
    def kern(*args):
        t = body(*args)
        out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    return nki.simulate(kern, target=target)(*arrays)


def _load(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    return t


def test_ap_pooling_pattern_matches_numpy() -> None:
    x = _rand(4, 6, 8)

    def body(x):
        t = _load(x)
        win = t.ap([[48, 4], [16, 3], [2, 4], [8, 2], [1, 2]])  # [c, h/2, w/2, 2, 2] windows
        r = nl.ndarray((4, 3, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(r, nl.maximum, win, axis=(3, 4))
        return r

    np.testing.assert_array_equal(_run(body, x), x.reshape(4, 3, 2, 4, 2).max((2, 4)))


def test_ap_offset_scalar_offset_and_dtype() -> None:
    x = _rand(6, 8)

    def body(x):
        t = _load(x)
        r = nl.ndarray((6, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r, t.ap([[8, 6], [2, 4]], offset=1))  # odd columns
        return r

    np.testing.assert_array_equal(_run(body, x), x[:, 1::2])

    def body2(x):
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(t, x.ap([[8, 1], [1, 8]], scalar_offset=3, indirect_dim=0))  # row 3 of HBM x
        return t

    np.testing.assert_array_equal(_run(body2, x), x[3:4])

    def body3(x):
        t = _load(x)
        return t.ap([[8, 6], [1, 8]], dtype=nl.int32)  # reinterpret the fp32 bits

    np.testing.assert_array_equal(_run(lambda x: _copy(body3(x)), x), x.view(np.int32))


def _copy(t):
    r = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(r, t)
    return r


@pytest.mark.parametrize(
    "pattern, err",
    [
        ([[16, 4], [1, 8]], "partition access"),  # reads every other partition
        ([[8, 6], [1, 9]], "reaches elements"),  # past the allocation
    ],
)
def test_ap_rules(pattern, err) -> None:
    with pytest.raises(nki.NkiValidationError, match=err):
        _run(lambda x: _load(x).ap(pattern), _rand(6, 8))


def test_view_methods() -> None:
    x = _rand(4, 2, 3, 5)

    def body(x):
        t = _load(x)
        v = t.permute((0, 3, 1, 2)).flatten_dims(2, 3)  # source dims 1 and 2 stay adjacent: still a view
        return _copy(v)

    np.testing.assert_array_equal(_run(body, x), x.transpose(0, 3, 1, 2).reshape(4, 5, 6))
    np.testing.assert_array_equal(
        _run(lambda x: _copy(_load(x).reshape_dim(1, (2, -1)).select(2, 1)), _rand(4, 6)).shape, (4, 2)
    )
    y = _rand(4, 6)
    np.testing.assert_array_equal(
        _run(lambda x: _copy(_load(x).rearrange(("p", ("h", "w")), ("p", "w", "h"), {"h": 2})), y),
        y.reshape(4, 2, 3).transpose(0, 2, 1),
    )
    np.testing.assert_array_equal(
        _run(lambda x: _copy(_load(x).slice(1, 1, 6, 2).expand_dim(1).squeeze_dim(1)), y), y[:, 1:6:2]
    )
    with pytest.raises(nki.NkiValidationError, match="partition dim"):
        _run(lambda x: _load(x).permute((1, 0)), y)


def test_broadcast_to_partition_and_free() -> None:
    x = _rand(1, 5)
    np.testing.assert_array_equal(_run(lambda x: nl.broadcast_to(_load(x), (128, 5)), x), np.repeat(x, 128, 0))
    y = _rand(3, 1)
    np.testing.assert_array_equal(_run(lambda x: nl.broadcast_to(_load(x), (3, 7)), y), np.repeat(y, 7, 1))
    with pytest.raises(nki.NkiValidationError, match="cannot broadcast"):
        _run(lambda x: nl.broadcast_to(_load(x), (3, 7)), _rand(3, 2))


@pytest.mark.parametrize(
    "ops, reverse",
    [
        (("multiply", "add"), (False, False)),
        (("add", "maximum"), (False, False)),
        (("subtract", "multiply"), (True, True)),
    ],
)
@pytest.mark.parametrize("initial", ["scalar", "tile"])
def test_tensor_tensor_scan(ops, reverse, initial) -> None:
    a, b, init = _rand(3, 7), _rand(3, 7), _rand(3, 1)
    f = {"multiply": np.multiply, "add": np.add, "maximum": np.maximum, "subtract": np.subtract}
    f0, f1 = f[ops[0]], f[ops[1]]
    prev = init[:, 0] if initial == "tile" else np.full(3, 0.5, np.float32)
    ref = np.empty_like(a)
    for i in range(7):
        t = f0(prev, a[:, i]) if reverse[0] else f0(a[:, i], prev)
        prev = f1(b[:, i], t) if reverse[1] else f1(t, b[:, i])
        ref[:, i] = prev

    def body(a, b, init):
        r = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(
            r,
            _load(a),
            _load(b),
            initial=_load(init) if initial == "tile" else 0.5,
            op0=getattr(nl, ops[0]),
            op1=getattr(nl, ops[1]),
            reverse0=reverse[0],
            reverse1=reverse[1],
        )
        return r

    np.testing.assert_allclose(_run(body, a, b, init), ref, rtol=1e-6, atol=1e-6)


def test_scalar_tensor_tensor_documented_and_legacy_names() -> None:
    x, y = _rand(4, 6), _rand(4, 6)

    def body(x, y, legacy):
        r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        kw = dict(scalar=2.0, data1=_load(y)) if legacy else dict(operand0=2.0, operand1=_load(y))
        nisa.scalar_tensor_tensor(dst=r, data=_load(x), op0=nl.multiply, op1=nl.add, **kw)
        return r

    for legacy in (False, True):
        np.testing.assert_allclose(_run(lambda a, b, legacy=legacy: body(a, b, legacy), x, y), 2 * x + y, rtol=1e-6)


def test_runtime_loops_and_scalars() -> None:
    x = _rand(6, 4)
    n = np.array([[4]], np.int32)

    def body(x, n):
        acc = nl.zeros((1, 4), nl.float32, buffer=nl.sbuf)
        row = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(cnt, n)
        stop = nisa.scalar_load(cnt)

        def step(i):  # i is a run-time NkiScalar: it addresses rows through .ap, never through [...]
            nisa.dma_copy(row, x.ap([[4, 1], [1, 4]], scalar_offset=i * 1 + 1, indirect_dim=0))
            nisa.tensor_tensor(acc, acc, row, nl.add)

        nl.fori_loop(0, stop, step)
        flag = stop - 1  # NkiScalar arithmetic: 3

        def halve(r):  # while_loop: runs 3 times, doubling acc each time
            nisa.tensor_scalar(acc, acc, nl.multiply, 2.0)
            return r - 1

        nl.while_loop(flag, halve)
        nl.if_else(stop - 4, lambda: nisa.memset(acc, 0.0))  # stop - 4 == 0: not taken
        return acc

    np.testing.assert_allclose(_run(body, x, n), 8 * x[1:5].sum(0, keepdims=True), rtol=1e-5)
    with pytest.raises(nki.NkiError, match="run-time value"):
        _run(lambda x, n: _load(x)[nisa.scalar_load(_load(n)) :], x, n)


def test_tile_and_block_grids() -> None:
    x = _rand(300, 200)

    @nki.jit
    def kern(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        src, dst = nl.blocks(x, tile_shape=(128, 64), block_shape=(1, 2)), nl.tiles(out, tile_shape=(128, 64))
        assert src.shape == (3, 2) and dst.shape == (3, 4)
        for bi in range(src.shape[0]):
            for bj in range(src.shape[1]):
                tiles = nl.tiles(src[bi, bj])
                work = nl.alloc_tiles(
                    tile_shape=(128, 64), element_shape=tiles.element_shape, buffer=nl.sbuf, dtype=x.dtype
                )
                for tj in range(tiles.shape[1]):
                    nisa.dma_copy(work[0, tj].data, tiles[0, tj].data)
                    nisa.tensor_scalar(work[0, tj].data, work[0, tj].data, nl.multiply, 3.0)
                    nisa.dma_copy(dst[bi, bj * 2 + tj].data, work[0, tj].data)
        return out

    np.testing.assert_allclose(kern(x), 3 * x, rtol=1e-6)


def test_lnc2_launch_shares_outputs_and_legacy_grid() -> None:
    x = _rand(8, 4)

    @nki.jit
    def kern(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        n, i = nl.num_programs(axes=0), nl.program_id(axis=0)
        rows = x.shape[0] // n
        t = _load(x[i * rows : (i + 1) * rows])
        nisa.tensor_scalar(t, t, nl.add, float(i))
        nisa.dma_copy(out[i * rows : (i + 1) * rows], t)
        return out

    np.testing.assert_allclose(kern[2](x), x + np.repeat([0.0, 1.0], 4)[:, None], rtol=1e-6)
    np.testing.assert_allclose(kern[4](x), x + np.repeat([0.0, 1, 2, 3], 2)[:, None], rtol=1e-6)


@pytest.mark.parametrize(
    "case, target, err",
    [
        ("scalar_copy", "trn1", "tensor_copy on the Scalar engine needs trn2"),
        ("gpsimd_activation", "trn2", "activation on the GpSimd engine needs trn3"),
        ("exponential", "trn2", "exponential needs trn3"),
        ("double_row_bf16", "trn2", "double_row takes fp8"),
    ],
)
def test_generation_rules(case, target, err) -> None:
    def body(x):
        t = _load(x)
        r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        if case == "scalar_copy":
            nisa.tensor_copy(r, t, engine=nisa.engine.scalar)
        elif case == "gpsimd_activation":
            nisa.activation(r, nl.exp, t, engine=nisa.engine.gpsimd)
        elif case == "exponential":
            nisa.exponential(r, t)
        else:
            bf = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(bf, t)
            nisa.nc_matmul(
                nl.ndarray((4, 4), nl.float32, buffer=nl.psum), bf, bf, perf_mode=nisa.matmul_perf_mode.double_row
            )
        return r

    with pytest.raises(nki.NkiValidationError, match=err):
        _run(body, _rand(4, 4), target=target)
    if case != "double_row_bf16":  # the same kernel is fine on trn3
        _run(body, _rand(4, 4), target="trn3")


def test_max8_topk_find_index8_and_predicated_copy() -> None:
    x = _rand(3, 20)

    def body(x):
        t = _load(x)
        m = nl.ndarray((3, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(m, t)
        idx = nl.ndarray((3, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(idx, t, m)
        vals, tidx = nl.ndarray((3, 5), nl.float32, buffer=nl.sbuf), nl.ndarray((3, 5), nl.uint32, buffer=nl.sbuf)
        nisa.topk(vals, tidx, t, 5)
        both = nl.ndarray((3, 26), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(both[:, 0:8], m)
        nisa.tensor_copy(both[:, 8:16], idx)
        nisa.tensor_copy(both[:, 16:21], tidx)
        pred = nl.ndarray((3, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(pred, vals, nl.greater, 0.0)
        zeros = nl.zeros((3, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy_predicated(zeros, vals, pred)
        nisa.tensor_copy(both[:, 21:26], zeros)
        return both

    r = _run(body, x)
    order = np.argsort(-x, axis=1, kind="stable")
    top = np.take_along_axis(x, order, 1)
    np.testing.assert_array_equal(r[:, :8], top[:, :8])
    np.testing.assert_array_equal(r[:, 8:16], order[:, :8])
    np.testing.assert_array_equal(r[:, 16:21], order[:, :5])
    np.testing.assert_array_equal(r[:, 21:26], np.maximum(top[:, :5], 0))


def test_dma_transpose_and_tile_size() -> None:
    import ml_dtypes

    x = _rand(16, 8).astype(ml_dtypes.bfloat16)

    def body(x):
        t = nl.ndarray((8, 16), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(t, x, axes=(1, 0))
        return t

    np.testing.assert_array_equal(_run(body, x), x.T)
    got = {}

    def sizes(x):
        got.update(
            fmax=nl.tile_size.sbuf_fmax_bytes,
            total=nl.tile_size.sbuf_size_bytes,
            bank=nl.tile_size.psum_bank_fmax_bytes,
        )
        return _load(x)

    _run(sizes, _rand(2, 2), target="trn2")
    assert got == {"fmax": 208 * 1024, "total": 128 * 224 * 1024, "bank": 2048}


def test_nki_object_dataclass_fields_and_install_as_nki() -> None:
    """AWS's NKI library declares its configuration objects as ``@dataclass class C(nl.NKIObject)`` with bare class
    attributes as fields, and imports ``nki.isa.constants``; ``install_as_nki`` makes ``import nki`` the emulator
    (in a subprocess: it changes sys.modules)."""
    import dataclasses
    import subprocess
    import sys

    @dataclasses.dataclass
    class Params(nl.NKIObject):
        size: int = 4
        offset = None
        active = False

    p = Params(offset=3, active=True)
    assert (p.size, p.offset, p.active) == (4, 3, True)
    code = (
        "from neuron_compile.kernels import nki_api; nki_api.install_as_nki(); "
        "import nki, nki.language as nl, nki.isa as nisa; from nki.isa.constants import oob_mode; "
        "from neuron_compile.kernels.emulator import language; "
        "assert nl is language and oob_mode is nisa.oob_mode and nki.lnc.sendrecv"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
