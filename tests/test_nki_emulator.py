"""The NKI emulator (neuron_compile.nki): semantics of the ISA ops, hardware-rule errors, NaN-filled new
memory, dtype rounding, views, counters and the shape-only mode."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
import torch

from neuron_compile import nki
from neuron_compile.kernels import cost

nl, nisa = nki.language, nki.isa
F32, BF16 = np.float32, ml_dtypes.bfloat16
rng = np.random.default_rng(0)


def rand(*shape, dtype=F32):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _sbuf(shape, dtype="float32"):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def _out_like(x, dtype=None):
    return nl.ndarray(x.shape, dtype or x.dtype, buffer=nl.shared_hbm)


@nki.jit
def copy_through_sbuf(x):
    t = _sbuf(x.shape, x.dtype)
    nisa.dma_copy(t, x)
    out = _out_like(x)
    nisa.dma_copy(out, t)
    return out


# ------------------------------------------------------------------------------------- hardware-rule errors
def k_partition_256(x):
    _sbuf((256, 4))


def k_psum_over_bank(x):
    nl.ndarray((128, 1024), "float32", buffer=nl.psum)


def k_psum_too_many_banks(x):
    keep = [nl.ndarray((128, 512), "float32", buffer=nl.psum) for _ in range(9)]
    return keep


def k_sbuf_capacity(x):
    _sbuf((128, 60 * 1024))  # 240 KiB per partition > 208 KiB usable on trn2


def k_matmul_moving_n(x):
    a, b = _sbuf((128, 128), "bfloat16"), _sbuf((128, 1024), "bfloat16")
    nisa.nc_matmul(nl.ndarray((128, 512), "float32", buffer=nl.psum), a, b)


def k_matmul_stationary_m(x):
    a, b = _sbuf((128, 256), "bfloat16"), _sbuf((128, 128), "bfloat16")
    nisa.nc_matmul(nl.ndarray((128, 128), "float32", buffer=nl.psum), a, b)


def k_matmul_reads_psum(x):
    a = nl.ndarray((128, 128), "float32", buffer=nl.psum)
    nisa.nc_matmul(nl.ndarray((128, 128), "float32", buffer=nl.psum), a, _sbuf((128, 128)))


def k_matmul_writes_sbuf(x):
    nisa.nc_matmul(_sbuf((128, 128)), _sbuf((128, 128)), _sbuf((128, 128)))


def k_matmul_mixed_fp32_bf16(x):
    nisa.nc_matmul(nl.ndarray((128, 128), "float32", buffer=nl.psum), _sbuf((128, 128)), _sbuf((128, 128), "bfloat16"))


def k_dma_reads_psum(x):
    nisa.dma_copy(_sbuf((128, 16)), nl.ndarray((128, 16), "float32", buffer=nl.psum))


def k_output_in_sbuf(x):
    t = _sbuf(x.shape)
    nisa.dma_copy(t, x)
    return t


def k_reduce_axis0(x):
    nisa.tensor_reduce(_sbuf((1, 16)), nl.add, _sbuf((128, 16)), axis=0)


def k_partition_mismatch(x):
    nisa.tensor_tensor(_sbuf((64, 16)), _sbuf((64, 16)), _sbuf((32, 32)), nl.add)


def k_out_of_bounds(x):
    t = _sbuf((128, 16))
    nisa.memset(t[:, 8:24], 0.0)


def k_gpsimd_psum(x):
    nisa.tensor_copy(_sbuf((128, 16)), nl.ndarray((128, 16), "float32", buffer=nl.psum), engine=nisa.gpsimd_engine)


def k_vector_free_size(x):
    t = _sbuf((2, 70000), "int8")  # Vector/Scalar/GpSimd operands hold at most 64K elements per partition
    nisa.tensor_copy(t, t)


def k_partition_start_misaligned(x):
    t = _sbuf((128, 16))
    nisa.memset(t[10:20], 0.0)  # 10 partitions may start at 0, 32, 64 or 96 only


def k_partition_stepped(x):
    t = _sbuf((128, 16))
    nisa.memset(t[::2], 0.0)


def k_reshape_count(x):
    _sbuf((128, 16)).reshape((128, 15))


def k_transpose_too_big_vector(x):
    nisa.nc_transpose(_sbuf((64, 64)), _sbuf((64, 64)), engine=nisa.vector_engine)


LIMIT_CASES = [
    (k_partition_256, "exceeds maximum 128"),
    (k_psum_over_bank, "more than one PSUM bank"),
    (k_psum_too_many_banks, "PSUM capacity exceeded"),
    (k_sbuf_capacity, "SBUF capacity exceeded on trn2"),
    (k_matmul_moving_n, "N=1024 exceeds maximum 512"),
    (k_matmul_stationary_m, "M=256 exceeds maximum 128"),
    (k_matmul_reads_psum, "stationary"),
    (k_matmul_writes_sbuf, "from psum"),
    (k_matmul_mixed_fp32_bf16, "fp32/tf32 operands must be paired"),
    (k_dma_reads_psum, "DMA cannot read PSUM"),
    (k_output_in_sbuf, "outputs must be allocated with nl.ndarray(..., buffer=nl.shared_hbm)"),
    (k_reduce_axis0, "partition axis 0 is never reduced"),
    (k_partition_mismatch, "partition counts differ"),
    (k_out_of_bounds, "access out of bound: [8:24] on dim 1 (size 16)"),
    (k_gpsimd_psum, "GpSimd engine cannot access PSUM"),
    (k_vector_free_size, "above the 65536 limit"),
    (k_reshape_count, "changes the element count"),
    (
        k_partition_start_misaligned,
        "starts at partition 10; an access of 10 partitions must start at partition 0 or 32",
    ),
    (k_partition_stepped, "compute engines access contiguous partitions only"),
    (k_transpose_too_big_vector, "exceeds 32x32 on the vector engine"),
]


@pytest.mark.parametrize("shape_only", [False, True], ids=["data", "shape_only"])
@pytest.mark.parametrize("kernel,message", LIMIT_CASES, ids=[k.__name__ for k, _ in LIMIT_CASES])
def test_hardware_rule_raises(kernel, message, shape_only):
    run = nki.infer_shapes if shape_only else nki.simulate
    with pytest.raises(nki.NkiValidationError) as info:
        run(nki.jit(kernel))(rand(128, 8))
    assert message in str(info.value), f"{kernel.__name__}: {info.value}"
    assert isinstance(info.value, nki.NkiError)


def test_capacity_depends_on_generation():
    @nki.jit
    def k(x):
        _sbuf((128, 56 * 1024))  # 224 KiB per partition: > trn2's 208, < trn3's 240

    with pytest.raises(nki.NkiValidationError, match="SBUF capacity exceeded on trn2"):
        nki.simulate(k)(rand(2, 2))
    nki.infer_shapes(k, target="trn3")(rand(2, 2))


def test_freed_tiles_release_capacity():
    def k(x):
        for _ in range(10):  # each tile takes 100 KiB per partition; only ~2 are ever live
            t = _sbuf((128, 25 * 1024))
            nisa.memset(t, 0.0)

    _, st = nki.simulate(nki.jit(k), stats=True)(rand(2, 2))
    assert st.sbuf_peak_bytes_per_partition == 2 * 100 * 1024


def _fills_sbuf_then_raises(x):
    big = _sbuf((128, 40 * 1024))  # 160 KiB of trn2's 208 KiB per partition
    banks = [nl.ndarray((128, 512), "float32", buffer=nl.psum) for _ in range(8)]  # every PSUM bank
    nisa.memset(big, 0.0)
    raise RuntimeError(f"kernel bug after allocating {big!r} and {len(banks)} PSUM tiles")


def test_tiles_kept_alive_by_a_failed_run_do_not_hold_capacity_in_the_next():
    """SBUF/PSUM is accounted per run and given back when the run ends: a traceback that keeps the tiles of a
    failed run alive must not make the next run, which needs most of SBUF and every PSUM bank, run out."""
    try:
        nki.simulate(nki.jit(_fills_sbuf_then_raises))(rand(2, 2))
    except RuntimeError as e:
        kept = e  # the traceback holds the failed kernel's frame, and so its tiles
    assert kept.__traceback__ is not None

    @nki.jit
    def needs_most_of_sbuf(x):
        big = _sbuf((128, 50 * 1024))  # 200 KiB per partition
        banks = [nl.ndarray((128, 512), "float32", buffer=nl.psum) for _ in range(8)]
        nisa.memset(big, 1.0)
        out = _out_like(x)
        nisa.dma_copy(out, big[: x.shape[0], : x.shape[1]])
        return out, len(banks)

    out, _ = nki.simulate(needs_most_of_sbuf)(rand(2, 2))
    assert (out == 1.0).all()
    del kept


def test_a_run_gives_back_its_memory_when_it_ends():
    """The accounting does not wait for the garbage collector: when a run ends (here, by raising) its ledger
    is empty although its tiles are still referenced, and their late release changes nothing."""
    from neuron_compile.kernels.emulator.run import current_run

    seen = []

    def k(x):
        seen.append(current_run())
        _fills_sbuf_then_raises(x)

    with pytest.raises(RuntimeError) as info:
        nki.simulate(nki.jit(k))(rand(2, 2))
    (run,) = seen
    assert info.value.__traceback__ is not None  # the tiles are alive...
    assert run.sbuf_used == 0 and run.psum_banks == [0] * run.gen.psum_banks  # ...but hold nothing
    assert run.memory.live == 0
    assert run.stats.sbuf_peak_bytes_per_partition == 160 * 1024
    del info
    gc.collect()  # the tiles die now: nothing is given back twice
    assert run.sbuf_used == 0 and run.psum_banks == [0] * run.gen.psum_banks


def test_psum_tiles_record_their_bank():
    """Each PSUM allocation holds a (bank, bytes) reservation: tiles of every size land in the bank the
    first-fit allocator picked, and freeing one gives back exactly its bytes in its bank."""
    from neuron_compile.kernels.emulator.run import current_run

    def k(x):
        run = current_run()
        tiles = [nl.ndarray((128, n), "float32", buffer=nl.psum) for n in (512, 256, 128, 256, 64)]
        assert [t._alloc.bank for t in tiles] == [0, 1, 1, 2, 1]
        assert run.psum_banks[:3] == [2048, 1792, 1024]
        del tiles[2]
        assert run.psum_banks[:3] == [2048, 1280, 1024]

    nki.simulate(nki.jit(k))(rand(2, 2))


# ------------------------------------------------------------------------------------------ memory contents
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_uninitialized_sbuf_reads_nan(dtype):
    @nki.jit
    def forgets_last_rows(x):  # a ragged-tile bug: rows 100.. never loaded
        t = _sbuf(x.shape, dtype)
        nisa.dma_copy(t[:100], x[:100])
        y = _sbuf(x.shape, dtype)
        nisa.activation(y, nl.exp, t)
        out = _out_like(x, dtype)
        nisa.dma_copy(out, y)
        return out

    x = rand(128, 8, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else F32)
    out = np.asarray(nki.simulate(forgets_last_rows)(x), np.float32)
    assert np.isfinite(out[:100]).all()
    assert np.isnan(out[100:]).all()


def test_new_int_memory_holds_4():
    @nki.jit
    def k(x):
        t = _sbuf((4, 4), "int32")
        out = nl.ndarray((4, 4), "int32", buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    assert (nki.simulate(k)(rand(2, 2)) == 4).all()


def test_views_share_storage():
    @nki.jit
    def k(x):
        t = nl.zeros((128, 16), "float32")
        nisa.memset(t[:, 4:8], 3.0)
        nisa.memset(t[0:2, nl.ds(10, 2)], 5.0)
        nisa.memset(t[32, ::5], 9.0)  # integer on the partition dim keeps it: shape (1, 4)
        out = nl.ndarray((128, 16), "float32", buffer=nl.shared_hbm)
        nisa.dma_copy(out, t)
        return out

    ref = np.zeros((128, 16), F32)
    ref[:, 4:8] = 3
    ref[0:2, 10:12] = 5
    ref[32, ::5] = 9
    np.testing.assert_array_equal(nki.simulate(k)(rand(2, 2)), ref)


def test_write_rounds_to_tile_dtype():
    x = rand(128, 64) * 1000
    out = nki.simulate(copy_through_sbuf)(x)  # same dtype: bit exact
    np.testing.assert_array_equal(out, x)

    @nki.jit
    def to_bf16(x):
        t = _sbuf(x.shape)
        nisa.dma_copy(t, x)
        b = _sbuf(x.shape, "bfloat16")
        nisa.tensor_copy(b, t)
        out = _out_like(x, "bfloat16")
        nisa.dma_copy(out, b)
        return out

    np.testing.assert_array_equal(nki.simulate(to_bf16)(x), x.astype(BF16))


# ------------------------------------------------------------------------------------------------ isa math
@nki.jit
def matmul_acc(a_t, b, mode):
    """a_t[K,M] stationary, b[K,N] moving, written twice into one PSUM tile with ``accumulate=mode``."""
    sa, sb = _sbuf(a_t.shape, a_t.dtype), _sbuf(b.shape, b.dtype)
    nisa.dma_copy(sa, a_t)
    nisa.dma_copy(sb, b)
    ps = nl.ndarray((a_t.shape[1], b.shape[1]), "float32", buffer=nl.psum)
    nisa.nc_matmul(ps, sa, sb, accumulate=False)
    nisa.nc_matmul(ps, sa, sb, accumulate=mode)
    res = _sbuf(ps.shape)
    nisa.tensor_copy(res, ps)
    out = nl.ndarray(ps.shape, "float32", buffer=nl.shared_hbm)
    nisa.dma_copy(out, res)
    return out


@pytest.mark.parametrize("mode,factor", [(False, 1), (True, 2), (None, 2)])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_nc_matmul_is_stationary_t_times_moving(mode, factor, dtype):
    a_t, b = rand(96, 80, dtype=dtype), rand(96, 300, dtype=dtype)
    ref = a_t.astype(np.float64).T @ b.astype(np.float64) * factor
    out = nki.simulate(matmul_acc)(a_t, b, mode)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)  # fp32 accumulation even for bf16 inputs


def test_accumulate_into_unwritten_psum_is_nan():
    @nki.jit
    def k(a):
        sa = _sbuf(a.shape)
        nisa.dma_copy(sa, a)
        ps = nl.ndarray((a.shape[1], a.shape[1]), "float32", buffer=nl.psum)
        nisa.nc_matmul(ps, sa, sa, accumulate=True)  # undefined on hardware: never-written PSUM
        res = _sbuf(ps.shape)
        nisa.tensor_copy(res, ps)
        out = nl.ndarray(ps.shape, "float32", buffer=nl.shared_hbm)
        nisa.dma_copy(out, res)
        return out

    assert np.isnan(nki.simulate(k)(rand(16, 8))).all()


@nki.jit
def vector_scalar_ops(x, bias):
    t = _sbuf(x.shape)
    nisa.dma_copy(t, x)
    bt = _sbuf(bias.shape)
    nisa.dma_copy(bt, bias)
    act, rsum = _sbuf(x.shape), _sbuf((x.shape[0], 1))
    nisa.activation(act, nl.exp, t, bias=bt, scale=0.5, reduce_op=nl.add, reduce_res=rsum)
    ts = _sbuf(x.shape)
    nisa.tensor_scalar(ts, t, nl.subtract, bt, op1=nl.multiply, operand1=3.0)
    tt = _sbuf(x.shape)
    nisa.tensor_tensor(tt, act, ts, nl.maximum)
    red = _sbuf((x.shape[0], 1))
    nisa.tensor_reduce(red, nl.maximum, tt, axis=1, keepdims=True)
    tp = nl.ndarray((x.shape[1], x.shape[0]), "float32", buffer=nl.psum)
    nisa.nc_transpose(tp, t)
    io = _sbuf(x.shape, "int32")
    nisa.iota(io, pattern=[[2, x.shape[1]]], offset=1, channel_multiplier=10)
    causal = _sbuf(x.shape)
    nisa.affine_select(
        causal,
        pattern=[[-1, x.shape[1]]],
        channel_multiplier=1,
        on_true_tile=t,
        on_false_value=-1e30,
        cmp_op=nl.greater_equal,
    )
    wrapped = nl.softmax(nl.add(nl.exp(t), bt))
    outs = []
    for tile in (act, rsum, ts, red, io, causal, wrapped):
        o = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(o, tile)
        outs.append(o)
    tps = _sbuf(tp.shape)
    nisa.tensor_copy(tps, tp)
    o = nl.ndarray(tps.shape, "float32", buffer=nl.shared_hbm)
    nisa.dma_copy(o, tps)
    return (*outs, o)


def test_vector_scalar_gpsimd_ops_match_numpy():
    x, bias = rand(64, 24), rand(64, 1)
    act, rsum, ts, red, io, causal, wrapped, tp = nki.simulate(vector_scalar_ops)(x, bias)
    ref_act = np.exp(x * 0.5 + bias)
    np.testing.assert_allclose(act, ref_act, rtol=1e-5)
    np.testing.assert_allclose(rsum[:, 0], ref_act.sum(1), rtol=1e-5)
    np.testing.assert_allclose(ts, (x - bias) * 3, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(red[:, 0], np.maximum(ref_act, (x - bias) * 3).max(1), rtol=1e-5)
    p, f = np.arange(64)[:, None], np.arange(24)[None, :]
    np.testing.assert_array_equal(io, 1 + 10 * p + 2 * f)
    np.testing.assert_array_equal(causal, np.where(p - f >= 0, x, np.float32(-1e30)))
    e = np.exp(x) + bias
    sm = np.exp(e - e.max(1, keepdims=True))
    np.testing.assert_allclose(wrapped, sm / sm.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(tp, x.T)


# ---------------------------------------------------------------------------------- counters and front end
def test_counters_per_engine_and_dma_bytes():
    a_t, b = rand(96, 80, dtype=BF16), rand(96, 300, dtype=BF16)
    _, st = nki.simulate(matmul_acc, stats=True)(a_t, b, True)
    assert st.engines["tensor"].instructions == 2
    assert st.engines["vector"].instructions == 1
    assert st.matmul_flops == 2 * 2 * 96 * 80 * 300
    assert st.dma_bytes_hbm_to_sbuf == (96 * 80 + 96 * 300) * 2
    assert st.dma_bytes_sbuf_to_hbm == 80 * 300 * 4
    assert nki.last_run_stats() is st
    est = cost.estimate(st)
    # two 300-column bf16 matmuls at max(N, 64) cycles on a 2.4 GHz TensorE, run at the cold (warming-up)
    # TensorE rate: between half and full speed
    assert st.engines["tensor"].cycles == 2 * 300
    assert 2 * 300 / 2.4e9 < est.engine_seconds["tensor"] <= 2 * 2 * 300 / 2.4e9


def test_torch_in_torch_out_and_in_place_update():
    x = torch.randn(128, 16, dtype=torch.bfloat16)
    out = copy_through_sbuf(x)  # calling a kernel runs it in the emulator
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, x, rtol=0, atol=0)

    @nki.jit
    def double_in_place(x):
        t = _sbuf(x.shape)
        nisa.dma_copy(t, x)
        nisa.tensor_scalar(t, t, nl.multiply, 2.0)
        nisa.dma_copy(x, t)

    y = torch.randn(64, 8)
    before = y.clone()
    nki.simulate(double_in_place)(y)
    torch.testing.assert_close(y, before * 2)


def test_shape_only_infers_outputs_without_data():
    from neuron_compile.kernels.matmul import matmul_kernel

    a = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4096, 1000, dtype=torch.bfloat16, device="meta")
    out, st = nki.infer_shapes(matmul_kernel, stats=True)(a, b)
    assert out == nki.TensorSpec((8192, 1000), "bfloat16") and out.torch_dtype() is torch.bfloat16
    # counted, not computed: 64 row tiles x 2 column tiles x 32 K tiles of matmuls + 64 x 32 PE transposes of a
    assert st.shape_only and st.engines["tensor"].instructions == 64 * 2 * 32 + 64 * 32
    assert st.matmul_flops == 2 * 8192 * 4096 * 1000  # PE transposes are not counted as flops


def test_lists_are_rejected_as_kernel_arguments():
    with pytest.raises(nki.NkiError, match="tuples, not lists"):
        nki.simulate(copy_through_sbuf)([rand(2, 2)])


def test_sub_kernel_is_inlined_into_the_calling_kernel():
    @nki.jit
    def inner(x):
        return nl.copy(nl.exp(nl.load(x)))

    @nki.jit
    def outer(x):
        out = _out_like(x)
        nl.store(out, inner(x))  # returns an SBUF tile: legal only because it is inlined
        return out

    x = rand(16, 8)
    np.testing.assert_allclose(outer(x), np.exp(x), rtol=1e-6)
    assert nki.last_run_stats().instructions() == {"tensor": 0, "vector": 1, "scalar": 1, "gpsimd": 0, "dma": 2}


def test_spmd_grid_runs_every_program():
    @nki.jit
    def halves(x, out):
        n = x.shape[0] // nl.num_programs(0)
        r0 = nl.program_id(0) * n
        t = _sbuf((n, x.shape[1]))
        nisa.dma_copy(t, x[r0 : r0 + n])
        nisa.tensor_scalar(t, t, nl.add, float(nl.program_id(0)))
        nisa.dma_copy(out[r0 : r0 + n], t)

    x, out = rand(64, 4), np.zeros((64, 4), F32)
    nki.simulate(halves[2])(x, out)  # LNC=2: both programs write their half of the output argument
    np.testing.assert_allclose(out, x + np.repeat([0.0, 1.0], 32)[:, None])


@pytest.mark.parametrize("shape_only", [False, True], ids=["data", "shape_only"])
def test_run_stats_name_the_arguments_written(shape_only):
    @nki.jit
    def add_into(src, acc):
        a, b = _sbuf((64, 8)), _sbuf((64, 8))
        nisa.dma_copy(a, src)
        nisa.dma_copy(b, acc[64:])
        nisa.tensor_tensor(b, a, b, nl.add)
        nisa.dma_copy(acc[64:], b)  # through a view: still the argument acc

    run = nki.infer_shapes if shape_only else nki.simulate
    _, st = run(add_into, stats=True)(rand(64, 8), rand(128, 8))
    assert st.written_args == ("acc",)


# ------------------------------------------------------------------------------------------ step budget
# Runaway kernels, bounded here at n steps so that they end (without a budget, as on main) instead of hanging.
def k_instruction_loop(x, n):
    t = _sbuf((128, 4))
    while n:  # a plain Python loop: the emulator sees only its instructions
        nisa.memset(t, 0.0)
        n -= 1


def k_nl_range_idle(x, n):
    for _ in nl.range(n):  # no instruction at all: its iterations count
        pass


def k_affine_range_idle(x, n):
    for _ in nl.affine_range(n):
        pass


def k_sequential_range_idle(x, n):
    for _ in nl.sequential_range(0, n, 1):
        pass


def k_fori_loop_idle(x, n):
    nl.fori_loop(0, n, lambda i: None)


RUNAWAY = [k_instruction_loop, k_nl_range_idle, k_affine_range_idle, k_sequential_range_idle, k_fori_loop_idle]


@pytest.mark.parametrize("shape_only", [False, True], ids=["data", "shape_only"])
@pytest.mark.parametrize("kernel", RUNAWAY, ids=[k.__name__ for k in RUNAWAY])
def test_step_budget_stops_a_runaway_kernel(kernel, shape_only):
    run = nki.infer_shapes if shape_only else nki.simulate
    with pytest.raises(nki.NkiBudgetError) as info:
        run(nki.jit(kernel), max_steps=1000)(rand(128, 4), 5000)
    message = str(info.value)
    assert f"NKI kernel {kernel.__name__} ran over the emulator's budget of 1,000 steps" in message, message
    assert "NEURON_COMPILE_NKI_MAX_STEPS=" in message and "max_steps=" in message, message
    assert nki.simulate(nki.jit(kernel), max_steps=1000)(rand(128, 4), 900) is None  # within budget: runs


@pytest.mark.parametrize("caller", ["call", "fake_tensors"])
def test_step_budget_from_the_environment(caller, monkeypatch):
    """The budget applies however a kernel runs: called directly (eager) or on fake tensors (tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("NEURON_COMPILE_NKI_MAX_STEPS", "1000")
    kernel = nki.jit(k_affine_range_idle)
    with pytest.raises(nki.NkiBudgetError, match="budget of 1,000 steps"):
        if caller == "call":
            kernel(torch.randn(4, 4), 5000)
        else:
            with FakeTensorMode():
                kernel(torch.empty(4, 4), 5000)
