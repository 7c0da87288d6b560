"""The device simulator itself (tests/device_sim): the fake neuronx-cc and the fake libnrt.so.1.

The runtime is driven through raw ctypes with argtypes/restypes written from AWS's headers (nrt.h,
nrt_experimental.h, nrt_status.h, nrt_version.h), not from the simulator's source, so a signature or layout
that drifts from the real one fails here.
"""

from __future__ import annotations

import contextlib
import ctypes as c
import json
import os
import struct
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests import device_sim
from tests.device_sim import compute, custom_calls, neuronx_cc

S = device_sim.STATUS
NO_FW = 1  # NRT_FRAMEWORK_TYPE_NO_FW
DEVICE = 0  # NRT_TENSOR_PLACEMENT_DEVICE
F32, BF16, I32, I64, U8, U32 = 0xA, 0x6, 0x8, 0xC, 0x3, 0x9  # nrt_dtype_t (hardware codes, nrt.h)


# ------------------------------------------------------------------------------- the real C interface
class TensorInfo(c.Structure):  # nrt_experimental.h: nrt_tensor_info_t
    _fields_ = [("name", c.c_char * 256), ("usage", c.c_int), ("size", c.c_size_t), ("dtype", c.c_int),
                ("shape", c.POINTER(c.c_uint32)), ("ndim", c.c_uint32)]  # fmt: skip


class TensorInfoArray(c.Structure):  # {uint64_t tensor_count; nrt_tensor_info_t tensor_array[];}
    _fields_ = [("tensor_count", c.c_uint64)]


class Version(c.Structure):  # nrt_version.h: nrt_version_t
    _fields_ = [("rt_major", c.c_uint64), ("rt_minor", c.c_uint64), ("rt_patch", c.c_uint64),
                ("rt_maintenance", c.c_uint64), ("rt_detail", c.c_char * 128), ("git_hash", c.c_char * 64)]  # fmt: skip


P = c.c_void_p
PP = c.POINTER(c.c_void_p)
SIGNATURES = {
    "nrt_init": ([c.c_int, c.c_char_p, c.c_char_p], c.c_int),
    "nrt_close": ([], None),
    "nrt_load": ([P, c.c_size_t, c.c_int32, c.c_int32, PP], c.c_int),
    "nrt_load_collectives": ([P, c.c_size_t, c.c_int32, c.c_int32, c.c_uint32, c.c_uint32, PP], c.c_int),
    "nrt_unload": ([P], c.c_int),
    "nrt_allocate_tensor_set": ([PP], c.c_int),
    "nrt_destroy_tensor_set": ([PP], None),
    "nrt_add_tensor_to_tensor_set": ([P, c.c_char_p, P], c.c_int),
    "nrt_get_tensor_from_tensor_set": ([P, c.c_char_p, PP], c.c_int),
    "nrt_execute": ([P, P, P], c.c_int),
    "nrt_tensor_allocate": ([c.c_int, c.c_int, c.c_size_t, c.c_char_p, PP], c.c_int),
    "nrt_tensor_free": ([PP], None),
    "nrt_tensor_write": ([P, P, c.c_size_t, c.c_size_t], c.c_int),
    "nrt_tensor_read": ([P, P, c.c_size_t, c.c_size_t], c.c_int),
    "nrt_tensor_get_size": ([P], c.c_size_t),
    "nrt_get_model_tensor_info": ([P, c.POINTER(c.POINTER(TensorInfoArray))], c.c_int),
    "nrt_free_model_tensor_info": ([c.POINTER(TensorInfoArray)], c.c_int),
    "nrt_get_visible_vnc_count": ([c.POINTER(c.c_uint32)], c.c_int),
    "nrt_get_total_vnc_count": ([c.POINTER(c.c_uint32)], c.c_int),
    "nrt_get_version": ([c.POINTER(Version), c.c_size_t], c.c_int),
    "nrt_get_status_as_str": ([c.c_int], c.c_char_p),
}

#: A process that only loads the library and calls it (no jax): sources for subprocess tests.
_SUBPROCESS_PRELUDE = textwrap.dedent("""
    import ctypes as c, sys
    lib = c.CDLL(sys.argv[1])
    P, PP = c.c_void_p, c.POINTER(c.c_void_p)
    lib.nrt_init.argtypes = [c.c_int, c.c_char_p, c.c_char_p]
    lib.nrt_load.argtypes = [P, c.c_size_t, c.c_int32, c.c_int32, PP]
    lib.nrt_tensor_allocate.argtypes = [c.c_int, c.c_int, c.c_size_t, c.c_char_p, PP]
    lib.nrt_allocate_tensor_set.argtypes = [PP]
    lib.nrt_execute.argtypes = [P, P, P]
    lib.nrt_unload.argtypes = [P]
    lib.nrt_get_visible_vnc_count.argtypes = [c.POINTER(c.c_uint32)]
    lib.nrt_close.restype = None
""")


@pytest.fixture(scope="module")
def lib():
    handle = c.CDLL(str(device_sim.build_libnrt()))
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, res
    return handle


class Runtime:
    """Thin helpers over the raw calls; every status is returned, none is hidden."""

    def __init__(self, lib):
        self.lib = lib

    def init(self):
        return self.lib.nrt_init(NO_FW, b"", b"")

    def load(self, neff, vnc=-1):
        model = c.c_void_p()
        return self.lib.nrt_load(neff, len(neff), vnc, -1, c.byref(model)), model

    def tensor(self, size, name=b"t", vnc=0):
        t = c.c_void_p()
        assert self.lib.nrt_tensor_allocate(DEVICE, vnc, size, name, c.byref(t)) == S["NRT_SUCCESS"]
        return t

    def tset(self, **named):
        s = c.c_void_p()
        assert self.lib.nrt_allocate_tensor_set(c.byref(s)) == S["NRT_SUCCESS"]
        for name, t in named.items():
            assert self.lib.nrt_add_tensor_to_tensor_set(s, name.encode(), t) == S["NRT_SUCCESS"]
        return s

    def write(self, t, data, offset=0):
        return self.lib.nrt_tensor_write(t, data, offset, len(data))

    def read(self, t, size, offset=0):
        buf = c.create_string_buffer(size)
        return self.lib.nrt_tensor_read(t, buf, offset, size), buf.raw

    def info(self, model):
        arr = c.POINTER(TensorInfoArray)()
        assert self.lib.nrt_get_model_tensor_info(model, c.byref(arr)) == S["NRT_SUCCESS"]
        base = c.addressof(arr.contents) + TensorInfoArray.tensor_count.size
        out = []
        for i in range(arr.contents.tensor_count):
            ti = TensorInfo.from_address(base + i * c.sizeof(TensorInfo))
            out.append({"name": ti.name.decode(), "usage": "in" if ti.usage == 0 else "out", "size": ti.size,
                        "nrt_dtype": ti.dtype, "shape": [ti.shape[d] for d in range(ti.ndim)]})  # fmt: skip
        assert self.lib.nrt_free_model_tensor_info(arr) == S["NRT_SUCCESS"]
        return out

    def run(self, neff, *arrays):
        """Load, bind every tensor by the reported names and sizes, write, execute, read, free: (status, outputs)."""
        st, model = self.load(neff)
        assert st == S["NRT_SUCCESS"]
        info = self.info(model)
        ins = {t["name"]: self.tensor(t["size"], t["name"].encode()) for t in info if t["usage"] == "in"}
        outs = {t["name"]: self.tensor(t["size"], t["name"].encode()) for t in info if t["usage"] == "out"}
        for a, (name, t) in zip(arrays, ins.items()):
            assert self.write(t, np.ascontiguousarray(a).tobytes()) == S["NRT_SUCCESS"], name
        in_set, out_set = self.tset(**ins), self.tset(**outs)
        status = self.lib.nrt_execute(model, in_set, out_set)
        results = [self.read(t, self.lib.nrt_tensor_get_size(t))[1] for t in outs.values()]
        for t in list(ins.values()) + list(outs.values()):
            self.lib.nrt_tensor_free(c.byref(t))
        self.lib.nrt_destroy_tensor_set(c.byref(in_set))
        self.lib.nrt_destroy_tensor_set(c.byref(out_set))
        assert self.lib.nrt_unload(model) == S["NRT_SUCCESS"]
        return status, results


_SIM_VARIABLES = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_LOGICAL_NC_CONFIG", "NRTSIM_INJECT",
                  "NRTSIM_NUM_DEVICES", "NRTSIM_COMPUTE", "NEURON_RT_NUMERICAL_ERRORS_VERBOSITY")  # fmt: skip


def _close_the_packages_runtime():
    """The process has one libnrt: when the package's binding holds it (a neuron-target test ran earlier in this
    worker), close it through the binding, which then starts it again when next needed, not behind its back."""
    binding = sys.modules.get("neuron_compile.runtime.libnrt")
    held = getattr(binding, "_RUNTIME", None)
    if held is not None and not getattr(held, "closed", True):
        held.close()


@pytest.fixture
def rt(lib, tmp_path, monkeypatch):
    """The runtime closed, counters zeroed, no injection pending, a private state dir (core locks)."""
    device_sim.activate(monkeypatch, state_dir=tmp_path / "state")
    for name in _SIM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    _close_the_packages_runtime()
    lib.nrt_close()
    device_sim.reset_counters()
    device_sim.clear_injections()
    yield Runtime(lib)
    lib.nrt_close()
    device_sim.clear_injections()


# ------------------------------------------------------------------------------- modules and NEFFs
def _lower(fn, *structs) -> str:
    with jax.enable_x64(True):  # as the package traces (interpreter.py)
        return jax.jit(lambda *a: fn(*a)).lower(*structs).as_text()  # a fresh function: no trace reused


def _f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _compile_argv(src, out, *extra, target="trn2", lnc="2", opt="-O2"):
    """neuron_compile's own command line (runtime/neuron.py NeuronTarget.command) with these values."""
    return ["compile", str(src), "--framework", "XLA", "--target", target, "--lnc", lnc, opt, "--model-type",
            "transformer", "--auto-cast", "none", "--native-int64", "enabled", *extra, "--output", str(out)]  # fmt: skip


def compile_text(directory: Path, text: str, *extra, name="m", **kw) -> tuple[int, bytes | None]:
    """Compile a StableHLO module with the fake compiler, handed over in the format its build parses
    (NRTSIM_COMPILER_INPUT: the HLO proto jaxlib makes of the module, for "hlo")."""
    from neuron_compile.runtime import jax_adapter

    out = directory / f"{name}.neff"
    if neuronx_cc.input_format() == "hlo":
        src = directory / f"{name}.hlo.pb"
        src.write_bytes(jax_adapter.hlo_module_proto(text))
    else:
        src = directory / f"{name}.mlir"
        src.write_text(text)
    status = neuronx_cc.main(_compile_argv(src, out, *extra, **kw))
    return status, (out.read_bytes() if status == 0 else None)


def _axpy(x, y):
    return x * 2 + y


def _two_outputs(x, y):
    from neuron_compile.lowering import device_calls

    with _target("neuron"):
        return x * 2 + y, device_calls.arg_extreme(x, 1, largest=True)


@contextlib.contextmanager
def _target(name):
    """Lower device calls for ``name`` ("cpu" / "neuron") outside the graph interpreter."""
    from neuron_compile.lowering import registry

    with registry.lowering_context(types.SimpleNamespace(target=name)):
        yield


@pytest.fixture(scope="module")
def neffs(tmp_path_factory):
    d = tmp_path_factory.mktemp("neffs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NRTSIM_STATE_DIR", str(d / "state"))
        texts = {
            "axpy": _lower(_axpy, _f32(2, 3), _f32(2, 3)),
            "two": _lower(_two_outputs, _f32(2, 3), _f32(2, 3)),
            "div": _lower(lambda x, y: x / y, _f32(4), _f32(4)),
        }
        out = {}
        for name, text in texts.items():
            status, neff = compile_text(d, text, name=name)
            assert status == 0, name
            out[name] = neff
        status, out["axpy_lnc1"] = compile_text(d, texts["axpy"], name="axpy_lnc1", lnc="1")
        assert status == 0
    return out


# ------------------------------------------------------------------------------- the compiler
def test_compiler_takes_the_packages_exact_command_line(tmp_path, monkeypatch):
    """The shim on PATH runs the fake compiler on the command line neuron_compile builds."""
    from neuron_compile.runtime import jax_adapter
    from neuron_compile.runtime.neuron import NeuronTarget

    state = tmp_path / "state"
    device_sim.activate(monkeypatch, state_dir=state)
    out = tmp_path / "module.neff"
    if neuronx_cc.input_format() == "hlo":
        src = tmp_path / "module.hlo.pb"
        src.write_bytes(jax_adapter.hlo_module_proto(_lower(_axpy, _f32(2, 3), _f32(2, 3))))
    else:
        src = tmp_path / "module.mlir"
        src.write_text(_lower(_axpy, _f32(2, 3), _f32(2, 3)))
    cmd = NeuronTarget(cache_dir=str(tmp_path / "cache")).command(str(src), str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)  # its log goes to its directory
    assert proc.returncode == 0, proc.stderr
    assert "Compiler status PASS" in proc.stdout
    assert "Running pass: write NEFF" in (tmp_path / neuronx_cc.LOG_FILE).read_text()
    neff = compute.read_neff(out.read_bytes())
    assert (neff.version, neff.lnc) == (1, 2)
    assert device_sim.compiler_invocations(state) == 1
    version = subprocess.run(["neuronx-cc", "--version"], capture_output=True, text=True)
    assert version.returncode == 0
    assert version.stdout.splitlines()[0] == f"NeuronX Compiler version {neuronx_cc.version()}"


@pytest.mark.parametrize(
    "extra, target, lnc, opt",
    [
        ((), "trn2", "2", "-O1"),
        ((), "trn3", "2", "-O3"),
        (
            ("--verbose", "info", "--enable-mixed-precision-accumulation", "--enable-saturate-infinity"),
            "trn2",
            "1",
            "-O2",
        ),
        (
            ("--distribution-strategy", "llm-training", "--enable-fast-context-switch", "--auto-cast-type", "fp16"),
            "trn2",
            "2",
            "-O2",
        ),
    ],
)
def test_compiler_accepts_documented_flags(tmp_path, monkeypatch, extra, target, lnc, opt):
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    status, neff = compile_text(
        tmp_path, _lower(_axpy, _f32(2, 3), _f32(2, 3)), *extra, target=target, lnc=lnc, opt=opt
    )
    assert status == 0
    assert compute.read_neff(neff).lnc == int(lnc)
    assert device_sim.compiler_invocations(tmp_path / "state") == 1


_GOOD = _lower(_axpy, _f32(2, 3), _f32(2, 3))


def _with_call(target, config):
    return textwrap.dedent(f"""\
        module @m {{
          func.func public @main(%arg0: tensor<2x3xf32>) -> tensor<2x3xf32> {{
            %0 = stablehlo.custom_call @{target}(%arg0) {{backend_config = "{config}"}} : (tensor<2x3xf32>) -> tensor<2x3xf32>
            return %0 : tensor<2x3xf32>
          }}
        }}
        """)


@pytest.mark.parametrize(
    "case, argv_edit, text, message",
    [
        ("unknown flag", lambda a: a[:-2] + ["--enable-warp-drive"] + a[-2:], _GOOD, "unrecognized arguments: --enable-warp-drive"),
        ("missing input", lambda a: [a[0], a[1] + ".missing"] + a[2:], _GOOD, "cannot read the input"),
        ("bad target", lambda a: [x if x != "trn2" else "trn9" for x in a], _GOOD, "argument --target: invalid choice: 'trn9'"),
        ("bad opt level", lambda a: [x if x != "-O2" else "-O4" for x in a], _GOOD, "invalid choice: '4'"),
        ("bad lnc", lambda a: [x if x != "2" else "3" for x in a], _GOOD, "invalid choice: 3"),
        ("unparsable", None, _GOOD.replace("stablehlo.add", "stablehlo.add_typo", 1), "m.mlir:"),
        ("unknown custom call", None, _with_call("AwsNeuronMystery", ""),
         f"[NCC_EVRF015] {neuronx_cc.EVRF015} (AwsNeuronMystery)"),
        ("not in EVRF015's list", None, _with_call("AwsNeuronGeluApprxTanhBackward", ""), "[NCC_EVRF015]"),
        ("bare --native-int64", lambda a: a[:a.index("enabled")] + a[a.index("enabled") + 1:], _GOOD,
         "argument --native-int64: expected one argument"),
        ("nki kernel", None, _with_call("AwsNeuronCustomNativeKernel", "eyJhcnRpZmFjdF9wYXRoIjogIi90bXAvZ29uZS9rZXJuZWwubmVmZiJ9"),
         "[NCC_EVRF059] Kernel file '/tmp/gone/kernel.neff' referenced by AwsNeuronCustomNativeKernel"),
        ("documented, not simulated", None, _with_call("AwsNeuronDropoutMaskV1", ""), "does not"),
        ("bad topk config", None, _with_call("AwsNeuronTopK", "many"), "[NCC_SIM"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 and "\n" not in v else "",
)  # fmt: skip
def test_compiler_refuses(tmp_path, monkeypatch, capsys, case, argv_edit, text, message):
    state = tmp_path / "state"
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(state))
    monkeypatch.setenv("NRTSIM_COMPILER_INPUT", "mlir")  # modules as text: the StableHLO build's refusals
    src, out = tmp_path / "m.mlir", tmp_path / "m.neff"
    src.write_text(text)
    argv = _compile_argv(src, out)
    if argv_edit:
        argv = argv_edit(argv)
    assert neuronx_cc.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()
    assert device_sim.compiler_invocations(state) == 0


def test_unparsable_module_names_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NRTSIM_COMPILER_INPUT", "mlir")
    bad = _GOOD.splitlines()
    line = next(i for i, s in enumerate(bad) if "stablehlo.add" in s)
    bad[line] = bad[line].replace("stablehlo.add", "stablehlo.add_typo")
    assert compile_text(tmp_path, "\n".join(bad))[0] == 1
    assert f"m.mlir:{line + 1}:" in capsys.readouterr().err


def test_neff_tensor_table_matches_the_module(rt, tmp_path):
    structs = [jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.bfloat16),
               jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.bool_),
               jax.ShapeDtypeStruct((3, 1), jnp.int64)]  # fmt: skip

    def fn(a, b, i, p, q):
        return a.sum() + b.astype(jnp.float32).sum(), (p.astype(jnp.uint32) + i.astype(jnp.uint32)), q * 2

    status, neff = compile_text(tmp_path, _lower(fn, *structs))
    assert status == 0
    want = [
        {"usage": "in", "name": "input0", "size": 24, "nrt_dtype": F32, "shape": [2, 3]},
        {"usage": "in", "name": "input1", "size": 8, "nrt_dtype": BF16, "shape": [4]},
        {"usage": "in", "name": "input2", "size": 4, "nrt_dtype": I32, "shape": []},
        {"usage": "in", "name": "input3", "size": 5, "nrt_dtype": U8, "shape": [5]},  # pred: one byte
        {"usage": "in", "name": "input4", "size": 24, "nrt_dtype": I64, "shape": [3, 1]},
        {"usage": "out", "name": "output0", "size": 4, "nrt_dtype": F32, "shape": []},
        {"usage": "out", "name": "output1", "size": 20, "nrt_dtype": U32, "shape": [5]},
        {"usage": "out", "name": "output2", "size": 24, "nrt_dtype": I64, "shape": [3, 1]},
    ]
    assert compute.read_neff(neff).table == want
    # ... and the runtime reports exactly that through nrt_tensor_info_t (the header's layout).
    assert rt.init() == S["NRT_SUCCESS"]
    st, model = rt.load(neff)
    assert st == S["NRT_SUCCESS"]
    assert rt.info(model) == want


# ------------------------------------------------------------------------------- the runtime
def test_struct_layout_is_the_headers():
    assert c.sizeof(TensorInfo) == 296
    offsets = [getattr(TensorInfo, f).offset for f in ("name", "usage", "size", "dtype", "shape", "ndim")]
    assert offsets == [0, 256, 264, 272, 280, 288]
    assert c.sizeof(Version) == 224


def test_call_order_is_enforced(lib, tmp_path):
    """In a fresh process: before nrt_init every call is NRT_UNINITIALIZED (the counts excepted), after
    nrt_close NRT_CLOSED; a second nrt_init fails; nrt_init after nrt_close starts again."""
    script = _SUBPROCESS_PRELUDE + textwrap.dedent("""
        m, t, s, n = c.c_void_p(), c.c_void_p(), c.c_void_p(), c.c_uint32()
        before = [lib.nrt_load(b"x" * 2048, 2048, -1, -1, c.byref(m)), lib.nrt_tensor_allocate(0, 0, 8, b"t", c.byref(t)),
                  lib.nrt_allocate_tensor_set(c.byref(s)), lib.nrt_execute(None, None, None), lib.nrt_unload(None)]
        count = lib.nrt_get_visible_vnc_count(c.byref(n))
        init, again = lib.nrt_init(1, b"", b""), lib.nrt_init(1, b"", b"")
        lib.nrt_close()
        after = [lib.nrt_load(b"x" * 2048, 2048, -1, -1, c.byref(m)), lib.nrt_allocate_tensor_set(c.byref(s))]
        reinit = lib.nrt_init(3, b"2.13", b"")
        print(before, count, n.value, init, again, after, reinit)
    """)
    env = dict(os.environ, NRTSIM_STATE_DIR=str(tmp_path))
    env.pop("NEURON_RT_VISIBLE_CORES", None)
    proc = subprocess.run([sys.executable, "-c", script, str(device_sim.build_libnrt())], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("] ", 1)[0] + "]" == str([S["NRT_UNINITIALIZED"]] * 5)
    assert proc.stdout.strip().split("] ", 1)[1] == f"0 4 0 {S['NRT_FAILURE']} [14, 14] 0"
    assert "already initialized" in proc.stderr


def test_full_call_order_computes(rt, neffs):
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    x[1, 0] = 7.0
    y = np.full((2, 3), 0.25, np.float32)
    assert rt.init() == S["NRT_SUCCESS"]
    n = c.c_uint32()
    assert rt.lib.nrt_get_visible_vnc_count(c.byref(n)) == 0 and n.value == 4
    status, (out0, out1) = rt.run(neffs["two"], x, y)
    assert status == S["NRT_SUCCESS"]
    np.testing.assert_array_equal(np.frombuffer(out0, np.float32).reshape(2, 3), x * 2 + y)
    np.testing.assert_array_equal(np.frombuffer(out1, np.int32), [2, 0])  # AwsNeuronArgMax, replaced at compile
    counts = device_sim.counters()
    assert counts == dict(counts, bytes_written=48, bytes_read=24 + 8, loads=1, unloads=1, executes=1,
                          tensors_allocated=4, tensors_freed=4, inits=1, live_models=0, live_tensors=0)  # fmt: skip
    rt.lib.nrt_close()
    assert device_sim.counters()["closes"] == 1


def test_threads_execute_one_model_at_once(rt, neffs):
    """Several Python threads in nrt_execute on one model (ctypes drops the GIL; the compute takes it back)."""
    import threading

    assert rt.init() == S["NRT_SUCCESS"]
    st, model = rt.load(neffs["axpy"])
    assert st == S["NRT_SUCCESS"]
    errors = []

    def worker(k):
        try:
            x, y = np.full((2, 3), k, np.float32), np.full((2, 3), 0.5, np.float32)
            ins, out = {"input0": rt.tensor(24), "input1": rt.tensor(24)}, rt.tensor(24)
            rt.write(ins["input0"], x.tobytes())
            rt.write(ins["input1"], y.tobytes())
            in_set, out_set = rt.tset(**ins), rt.tset(output0=out)
            for _ in range(5):
                assert rt.lib.nrt_execute(model, in_set, out_set) == S["NRT_SUCCESS"]
                assert np.array_equal(np.frombuffer(rt.read(out, 24)[1], np.float32), np.full(6, 2 * k + 0.5))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert device_sim.counters()["executes"] == 20


def test_version_and_status_strings(rt):
    v = Version()
    assert rt.lib.nrt_get_version(c.byref(v), c.sizeof(v)) == S["NRT_SUCCESS"]  # callable before nrt_init
    assert v.rt_major == 2 and v.rt_detail
    assert rt.lib.nrt_get_status_as_str(S["NRT_EXEC_NC_BUSY"]) == b"NRT_EXEC_NC_BUSY"
    assert rt.lib.nrt_get_status_as_str(S["NRT_UNINITIALIZED"]) == b"NRT_UNINITIALIZED"


@pytest.mark.parametrize(
    "bind, expected, words",
    [
        (lambda i, o: ({"input0": i["input0"]}, o), "NRT_INVALID", ["input1", "24 bytes"]),
        (lambda i, o: ({"input0": i["input0"], "x": i["input1"]}, o), "NRT_INVALID", ["input1"]),
        (lambda i, o: ({"input0": i["input0"], "input1": i["short"]}, o), "NRT_INVALID", ["input1", "expected 24 bytes, given 20"]),
        (lambda i, o: (i, {"output0": o["long"]}), "NRT_INVALID", ["output0", "expected 24 bytes, given 28"]),
    ],
    ids=["input missing", "input under another name", "input too small", "output too large"],
)  # fmt: skip
def test_execute_binds_by_exact_name_and_size(rt, neffs, capfd, bind, expected, words):
    assert rt.init() == S["NRT_SUCCESS"]
    st, model = rt.load(neffs["axpy"])
    assert st == S["NRT_SUCCESS"]
    ins = {"input0": rt.tensor(24), "input1": rt.tensor(24), "short": rt.tensor(20)}
    outs = {"output0": rt.tensor(24), "long": rt.tensor(28)}
    i, o = bind(ins, outs)
    assert rt.lib.nrt_execute(model, rt.tset(**{k: v for k, v in i.items() if k != "short"}),
                              rt.tset(**{k: v for k, v in o.items() if k != "long"})) == S[expected]  # fmt: skip
    err = capfd.readouterr().err
    assert all(w in err for w in words), err
    assert device_sim.counters()["executes"] == 0


@pytest.mark.parametrize(
    "offset, size, expected",
    [(0, 24, 0), (8, 16, 0), (24, 0, 0), (0, 25, 2), (20, 8, 2), (25, 0, 2), (2**64 - 1, 2, 2)],
)
def test_read_write_bounds(rt, offset, size, expected):
    assert rt.init() == S["NRT_SUCCESS"]
    t = rt.tensor(24)
    buf = c.create_string_buffer(b"\x07" * max(size, 1))
    assert rt.lib.nrt_tensor_write(t, buf, offset, size) == expected
    assert rt.lib.nrt_tensor_read(t, buf, offset, size) == expected
    counts = device_sim.counters()
    assert (counts["bytes_written"], counts["bytes_read"]) == ((size, size) if expected == 0 else (0, 0))


def test_bytes_are_counted(rt):
    assert rt.init() == S["NRT_SUCCESS"]
    t = rt.tensor(64)
    for k in range(3):
        assert rt.write(t, b"\1" * 10, offset=k * 10) == 0
    assert rt.read(t, 64)[0] == 0
    assert rt.read(t, 5, offset=59) == (0, b"\0" * 5)
    assert rt.read(t, 4, offset=28) == (0, b"\1\1\0\0")
    counts = device_sim.counters()
    assert (counts["bytes_written"], counts["bytes_read"]) == (30, 64 + 5 + 4)


def _header(neff, **fields):
    magic, version, lnc, reserved, t_off, t_size, p_off, p_size = struct.unpack_from("<12sIIIQQQQ", neff)
    values = dict(magic=magic, version=version, lnc=lnc, reserved=reserved, t_off=t_off, t_size=t_size,
                  p_off=p_off, p_size=p_size)  # fmt: skip
    values.update(fields)
    return struct.pack("<12sIIIQQQQ", *values.values()) + neff[56:]


@pytest.mark.parametrize(
    "edit, expected, words",
    [
        (lambda n: _header(n, magic=b"NOTANEFF\0\0\0\0"), "NRT_INVALID", ["bad magic"]),
        (lambda n: n[:1000], "NRT_INVALID", ["truncated"]),
        (lambda n: n[: len(n) - 10], "NRT_INVALID", ["outside"]),
        (lambda n: _header(n, version=2), "NRT_UNSUPPORTED_NEFF_VERSION", ["supported: 1 received: 2"]),
        (lambda n: _header(n, lnc=1), "NRT_INVALID", ["LNC=1", "LNC=2"]),
    ],
)
def test_load_checks_the_neff(rt, neffs, capfd, edit, expected, words):
    assert rt.init() == S["NRT_SUCCESS"]
    assert rt.load(edit(neffs["axpy"]))[0] == S[expected]
    err = capfd.readouterr().err
    assert all(w in err for w in words), err
    assert device_sim.counters()["loads"] == 0


def test_lnc_must_match_the_runtime(rt, neffs, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert rt.init() == S["NRT_SUCCESS"]
    n = c.c_uint32()
    assert rt.lib.nrt_get_total_vnc_count(c.byref(n)) == 0 and n.value == 8  # 8 physical cores, LNC=1
    assert rt.load(neffs["axpy"])[0] == S["NRT_INVALID"]  # compiled with --lnc 2
    assert rt.load(neffs["axpy_lnc1"])[0] == S["NRT_SUCCESS"]


_INJECTABLE = [
    ("nrt_load", lambda rt, neffs: rt.load(neffs["axpy"])[0]),
    ("nrt_tensor_allocate", lambda rt, neffs: rt.lib.nrt_tensor_allocate(DEVICE, 0, 8, b"t", c.byref(c.c_void_p()))),
    (
        "nrt_execute",
        lambda rt, neffs: rt.run(neffs["axpy"], np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))[0],
    ),
    ("nrt_get_visible_vnc_count", lambda rt, neffs: rt.lib.nrt_get_visible_vnc_count(c.byref(c.c_uint32()))),
]


@pytest.mark.parametrize("status", sorted(set(S.values()) - {0}))
@pytest.mark.parametrize("function, call", _INJECTABLE, ids=[f for f, _ in _INJECTABLE])
def test_injection_returns_each_status(rt, neffs, function, call, status):
    assert rt.init() == S["NRT_SUCCESS"]
    device_sim.inject(function, status, count=2)
    before = device_sim.counters()
    assert [call(rt, neffs), call(rt, neffs)] == [status, status]
    after = device_sim.counters()
    if function == "nrt_execute":  # run() itself loads and allocates around the injected execute
        assert after["executes"] == before["executes"]
    else:
        assert after == before  # an injected call does nothing else
    assert call(rt, neffs) == S["NRT_SUCCESS"]


def test_injection_from_the_environment(rt, neffs, monkeypatch):
    monkeypatch.setenv("NRTSIM_INJECT", "nrt_load:4:1,nrt_execute:1005:1")
    assert rt.init() == S["NRT_SUCCESS"]
    assert rt.load(neffs["axpy"])[0] == S["NRT_RESOURCE"]
    assert rt.run(neffs["axpy"], np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))[0] == S["NRT_EXEC_NC_BUSY"]
    assert rt.run(neffs["axpy"], np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))[0] == S["NRT_SUCCESS"]


@pytest.mark.parametrize(
    "env, visible, total",
    [
        ({}, 4, 4),
        ({"NEURON_RT_VISIBLE_CORES": "0"}, 1, 4),
        ({"NEURON_RT_VISIBLE_CORES": "1-3"}, 3, 4),
        ({"NEURON_RT_VISIBLE_CORES": "2,3"}, 2, 4),
        ({"NEURON_RT_VISIBLE_CORES": "0-1,2"}, 3, 4),
        ({"NEURON_RT_NUM_CORES": "2"}, 2, 4),
        ({"NEURON_LOGICAL_NC_CONFIG": "1"}, 8, 8),
        ({"NRTSIM_NUM_DEVICES": "2", "NEURON_RT_VISIBLE_CORES": "4-7"}, 4, 8),
    ],
)
def test_visible_and_total_cores(rt, monkeypatch, env, visible, total):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    n, m = c.c_uint32(), c.c_uint32()
    assert rt.lib.nrt_get_visible_vnc_count(c.byref(n)) == 0 and n.value == visible  # before nrt_init too
    assert rt.init() == S["NRT_SUCCESS"]
    assert rt.lib.nrt_get_visible_vnc_count(c.byref(n)) == 0 and rt.lib.nrt_get_total_vnc_count(c.byref(m)) == 0
    assert (n.value, m.value) == (visible, total)


@pytest.mark.parametrize("visible", ["0,2", "4", "1-0", "a", "0-1,1"])
def test_bad_visible_cores_fail_init(rt, monkeypatch, capfd, visible):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", visible)
    assert rt.init() == S["NRT_FAILURE"]
    assert "NEURON_RT_VISIBLE_CORES" in capfd.readouterr().err


@pytest.mark.parametrize("vnc, expected", [(0, 0), (1, 0), (-1, 0), (2, 9), (7, 9), (-2, 2)])
def test_load_places_on_the_processes_cores(rt, neffs, monkeypatch, vnc, expected):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "2-3")  # this process's vnc 0 and 1
    assert rt.init() == S["NRT_SUCCESS"]
    assert rt.load(neffs["axpy"], vnc=vnc)[0] == expected


def test_a_core_is_held_by_one_process(rt, neffs, tmp_path, monkeypatch, capfd):
    """Another process holding core 0 (it loaded there) fails this process's nrt_init on core 0, not on core 1;
    the core is free again once that process exits."""
    neff_path = tmp_path / "axpy.neff"
    neff_path.write_bytes(neffs["axpy"])
    holder = _SUBPROCESS_PRELUDE + textwrap.dedent("""
        neff = open(sys.argv[2], "rb").read()
        m = c.c_void_p()
        print(lib.nrt_init(1, b"", b""), lib.nrt_load(neff, len(neff), 0, -1, c.byref(m)), flush=True)
        sys.stdin.read()
        lib.nrt_close()
    """)
    env = dict(os.environ, NEURON_RT_VISIBLE_CORES="0")
    child = subprocess.Popen([sys.executable, "-c", holder, str(device_sim.build_libnrt()), str(neff_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert child.stdout.readline().split() == ["0", "0"]
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
        assert rt.init() == S["NRT_FAILURE"]
        assert "Logical Neuron Core(s) not available - Requested:lnc0-lnc0" in capfd.readouterr().err
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1")
        assert rt.init() == S["NRT_SUCCESS"]
        rt.lib.nrt_close()
        monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")  # all four: core 0 among them
        assert rt.init() == S["NRT_FAILURE"]
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    assert rt.init() == S["NRT_SUCCESS"]


def test_stale_handles(rt, neffs):
    assert rt.init() == S["NRT_SUCCESS"]
    st, model = rt.load(neffs["axpy"])
    t = rt.tensor(24)
    kept = c.c_void_p(t.value)
    rt.lib.nrt_tensor_free(c.byref(t))
    assert t.value is None  # nrt_tensor_free sets the pointer to NULL
    assert rt.write(kept, b"\0" * 4) == S["NRT_INVALID_HANDLE"]
    assert rt.lib.nrt_tensor_get_size(kept) == 0
    s = rt.tset()
    kept_set = c.c_void_p(s.value)
    rt.lib.nrt_destroy_tensor_set(c.byref(s))
    assert s.value is None
    assert rt.lib.nrt_execute(model, kept_set, kept_set) == S["NRT_INVALID_HANDLE"]
    assert rt.lib.nrt_unload(model) == S["NRT_SUCCESS"]
    assert rt.lib.nrt_unload(model) == S["NRT_INVALID_HANDLE"]
    assert rt.lib.nrt_unload(None) == S["NRT_INVALID_HANDLE"]
    assert rt.lib.nrt_unload(c.c_void_p(0x1000)) == S["NRT_INVALID_HANDLE"]  # never dereferenced


def test_tensor_set_lookup(rt):
    assert rt.init() == S["NRT_SUCCESS"]
    a, b = rt.tensor(4), rt.tensor(8)
    s = rt.tset(x=a)
    assert rt.lib.nrt_add_tensor_to_tensor_set(s, b"x", b) == 0  # add/replace
    got = c.c_void_p()
    assert rt.lib.nrt_get_tensor_from_tensor_set(s, b"x", c.byref(got)) == 0 and got.value == b.value
    assert rt.lib.nrt_get_tensor_from_tensor_set(s, b"y", c.byref(got)) == S["NRT_FAILURE"]


def test_collective_loads(rt, neffs, monkeypatch):
    assert rt.init() == S["NRT_SUCCESS"]
    neff = neffs["axpy"]
    m = c.c_void_p()
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)  # mandatory for collectives (developer guide)
    assert rt.lib.nrt_load_collectives(neff, len(neff), 0, -1, 1, 2, c.byref(m)) == S["NRT_FAILURE"]
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "localhost")  # no port
    assert rt.lib.nrt_load_collectives(neff, len(neff), 0, -1, 1, 2, c.byref(m)) == S["NRT_FAILURE"]
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "127.0.0.1:62182")
    assert rt.lib.nrt_load_collectives(neff, len(neff), 0, -1, 1, 2, c.byref(m)) == S["NRT_SUCCESS"]
    assert rt.lib.nrt_load_collectives(neff, len(neff), 0, -1, 2, 2, c.byref(m)) == S["NRT_INVALID"]
    assert rt.lib.nrt_load_collectives(neff, len(neff), 0, -1, 0, 0, c.byref(m)) == S["NRT_INVALID"]
    counts = device_sim.counters()
    assert (counts["collective_loads"], counts["loads"], counts["live_models"]) == (1, 1, 1)


def test_a_python_failure_is_nrt_failure(rt, neffs, monkeypatch, capfd):
    monkeypatch.setenv("NRTSIM_COMPUTE", "tests.device_sim.no_such_module")
    assert rt.init() == S["NRT_SUCCESS"]
    status, _ = rt.run(neffs["axpy"], np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))
    assert status == S["NRT_FAILURE"]
    err = capfd.readouterr().err
    assert "ModuleNotFoundError" in err and "no_such_module" in err


@pytest.mark.parametrize(
    "verbosity, expected",
    [(None, "NRT_SUCCESS"), ("none", "NRT_SUCCESS"), ("critical", "NRT_EXEC_COMPLETED_WITH_NUM_ERR")],
)
def test_nan_is_reported_when_asked(rt, neffs, monkeypatch, verbosity, expected):
    if verbosity:
        monkeypatch.setenv("NEURON_RT_NUMERICAL_ERRORS_VERBOSITY", verbosity)
    assert rt.init() == S["NRT_SUCCESS"]
    status, (out,) = rt.run(neffs["div"], np.array([1, 0, 3, 4], np.float32), np.array([2, 0, 1, 4], np.float32))
    assert status == S[expected]
    got = np.frombuffer(out, np.float32)
    assert got[0] == 0.5 and np.isnan(got[1])  # the outputs are written either way


def test_bad_numerics_verbosity_fails_init(rt, monkeypatch):
    monkeypatch.setenv("NEURON_RT_NUMERICAL_ERRORS_VERBOSITY", "loud")
    assert rt.init() == S["NRT_INVALID"]


# ------------------------------------------------------------------------------- custom calls
def _custom_call_cases():
    from neuron_compile.kernels import norms
    from neuron_compile.lowering import activations as act
    from neuron_compile.lowering import device_calls as dc
    from neuron_compile.lowering import nn, sorting

    def softmax_ref(v, axis):  # nn.softmax's CPU-target reference
        shifted, total, _ = nn._softmax_parts(v, axis)
        return lax.div(jnp.exp(shifted), total)

    def softmax_bwd_ref(g, y, axis):  # nn.softmax_backward's
        gy = lax.mul(g, y)
        return lax.sub(gy, lax.mul(y, jnp.sum(gy, axis=axis, keepdims=True)))

    def gelu_bwd_ref(approximate):  # activations.gelu_backward's
        return lambda g, v: act._gelu_backward_formula(g, v, approximate)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6)).astype(np.float32) * 3
    g = rng.standard_normal((4, 6)).astype(np.float32)
    w = rng.standard_normal((6,)).astype(np.float32)
    x3 = rng.standard_normal((3, 5, 4)).astype(np.float32)
    ties = np.array(
        [[1, 5, 5, 2, 5, 0], [np.nan, 3, np.nan, 9, 9, 1], [-1, -1, -4, -4, 0, -4], [2, 2, 2, 2, 2, 2]], np.float32
    )  # ties, NaN (the extreme of argmax/topk), a constant row
    return {
        "AwsNeuronErf": (dc.erf, [x], 1e-6),
        "AwsNeuronGelu": (lambda v: dc.gelu(v, "none", reference=lambda a: act._gelu_formula(a, "none")), [x], 1e-6),
        "AwsNeuronGelu-bf16": (lambda v: dc.gelu(v, "none", reference=lambda a: act._gelu_formula(a, "none")),
                               [x.astype(jnp.bfloat16)], 1e-2),
        "AwsNeuronGeluApprxTanh": (lambda v: dc.gelu(v, "tanh", reference=lambda a: act._gelu_formula(a, "tanh")), [x], 1e-6),
        "AwsNeuronGeluBackward": (lambda a, b: dc.gelu_backward(a, b, "none", gelu_bwd_ref("none")), [g, x], 1e-6),
        "AwsNeuronGeluApprxTanhBackward": (lambda a, b: dc.gelu_backward(a, b, "tanh", gelu_bwd_ref("tanh")), [g, x], 1e-6),
        "AwsNeuronSilu": (lambda v: dc.silu(v, reference=lambda a: lax.mul(a, lax.logistic(a))), [x], 1e-6),
        "AwsNeuronSiluBackward": (lambda a, b: dc.silu_backward(a, b, act._silu_backward_formula), [g, x], 1e-6),
        "AwsNeuronSoftmax": (lambda v: dc.softmax(v, 1, softmax_ref), [x3], 1e-6),
        "AwsNeuronSoftmaxBackward": (lambda a, b: dc.softmax_backward(a, b, 0, softmax_bwd_ref), [g, np.abs(x) / 10], 1e-6),
        "AwsNeuronRmsNorm": (lambda a, b: dc.rms_norm(a, b, 1e-5, lambda p, q: norms.rms_norm_reference(p, q, 1e-5)), [x, w], 1e-6),
        "AwsNeuronArgMax": (lambda v: dc.arg_extreme(v, 1, largest=True), [ties], 0),
        "AwsNeuronArgMin": (lambda v: dc.arg_extreme(v, 0, largest=False), [np.nan_to_num(ties.T, nan=-7)], 0),
        "AwsNeuronTopK": (lambda v: sorting.top_k(v, 3, 1, largest=True), [ties], 0),
        "AwsNeuronTopK-smallest": (lambda v: sorting.top_k(v, 2, 0, largest=False), [np.nan_to_num(ties, nan=8)], 0),
        "AwsNeuronTopK-bf16": (lambda v: sorting.top_k(v, 4, 1, largest=True), [x.astype(jnp.bfloat16)], 0),
    }  # fmt: skip


_CASES = sorted(_custom_call_cases())


def test_every_emitted_custom_call_is_simulated():
    """Each AwsNeuron* target device_calls.py can emit has a case below and an implementation."""
    source = (Path(__file__).parents[1] / "neuron_compile" / "lowering" / "device_calls.py").read_text()
    import re

    from neuron_compile.lowering import device_calls as dc

    listed = source.index("COMPILER_TARGETS = frozenset(")
    source = source[:listed] + source[source.index("# fmt: skip", listed) :]  # the names it calls, not the list
    emitted = set(re.findall(r'"(AwsNeuron[A-Za-z]+)"', source))
    assert custom_calls.DOCUMENTED_TARGETS == dc.COMPILER_TARGETS  # EVRF015's list, in the fake and the package
    assert emitted & dc.COMPILER_TARGETS <= custom_calls.IMPLEMENTED
    assert emitted <= {case.split("-")[0] for case in _CASES}


@pytest.mark.parametrize("case", _CASES)
def test_custom_call_matches_the_cpu_reference(tmp_path, monkeypatch, case):
    fn, arrays, tol = _custom_call_cases()[case]
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    with _target("neuron"):
        text = _lower(fn, *structs)
    target = case.split("-")[0]
    if target in custom_calls.DOCUMENTED_TARGETS:
        assert f"stablehlo.custom_call @{target}(" in text and "api_version = 0 : i32" in text
    else:  # not one neuronx-cc recognises (NCC_EVRF015's list): its reference StableHLO instead
        assert "custom_call" not in text and f"@{target}__stablehlo(" in text
    status, neff = compile_text(tmp_path, text)
    assert status == 0
    sim_text = compute.read_neff(neff).files["module.sim.mlir"].decode()
    assert "custom_call" not in sim_text
    assert f"call @{target}__nrtsim0(" in sim_text or target not in custom_calls.DOCUMENTED_TARGETS
    got = compute.execute(neff, {f"input{i}": np.ascontiguousarray(a).tobytes() for i, a in enumerate(arrays)})
    with _target("cpu"), jax.enable_x64(True):
        want = jax.jit(lambda *a: fn(*a))(*arrays)
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(got) == len(want)
    for i, w in enumerate(want):
        w = np.asarray(w)
        g = np.frombuffer(got[f"output{i}"], w.dtype).reshape(w.shape)
        if tol:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------------------- collectives
def _emit(x, kind, groups, reduce_op="sum"):
    """The package's own StableHLO collective (lowering/collectives.py), as the neuron target emits it."""
    from neuron_compile.lowering.collectives import _emit as emit

    return emit(x, kind, groups, reduce_op)


def _collective_module(coll):
    """Values crossing the collectives (a 0-d one, one used only inside a while loop's body), an all_gather,
    all_reduce sum and max; ``coll(x, kind, reduce_op)`` is the collective (the identity: a world of one)."""

    def fn(x):
        s = jnp.sum(x)
        y = coll(x @ x.T, "all_reduce", "sum")
        z = coll(jnp.tanh(y[:2]), "all_gather", "sum")
        w = coll(z.sum(0) * x[:, :1].T, "all_reduce", "max")
        v = lax.fori_loop(0, 3, lambda i, c: c + y[0, 0] * s, w)
        return y.sum(1) + v.sum() + coll(x.mean(), "all_reduce", "sum"), s

    return fn


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (replica groups [[0]])."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_a_module_with_collectives_runs_in_stages_cut_at_them(tmp_path, monkeypatch, world_of_one):
    """The fake compiler lists the module's collectives in neff.json; the NEFF runs as stages between them,
    each collective through torch.distributed, the values crossing the cuts as they are: the results are the
    module's (in a world of one, every collective is the identity)."""
    from tests.device_sim import collectives

    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    text = _lower(_collective_module(lambda x, kind, op: _emit(x, kind, [[0]], op)), _f32(4, 4))
    status, neff = compile_text(tmp_path, text)
    assert status == 0
    listed = json.loads(compute.read_neff(neff).files["neff.json"])["collectives"]
    assert [(c["op"], c["replica_groups"], c.get("reduce")) for c in listed] == [
        ("stablehlo.all_reduce", [[0]], "sum"), ("stablehlo.all_gather", [[0]], None),
        ("stablehlo.all_reduce", [[0]], "max"), ("stablehlo.all_reduce", [[0]], "sum")]  # fmt: skip
    plan = collectives.split(compute.read_neff(neff).files["module.sim.mlir"].decode())
    assert len(plan.stages) == 5 and [c.kind for c in plan.collectives] == [
        "all_reduce",
        "all_gather",
        "all_reduce",
        "all_reduce",
    ]
    assert all("stablehlo.all_" not in s.text for s in plan.stages if s.text)
    calls = []
    real_run = collectives.run
    monkeypatch.setattr(collectives, "run", lambda c, operands: calls.append(c.kind) or real_run(c, operands))
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    got = compute.execute(neff, {"input0": x.tobytes()})
    assert calls == ["all_reduce", "all_gather", "all_reduce", "all_reduce"]
    with jax.enable_x64(True):
        want = jax.jit(_collective_module(lambda v, kind, op: v))(x)
    np.testing.assert_allclose(np.frombuffer(got["output0"], np.float32), np.asarray(want[0]), rtol=1e-6)
    assert np.frombuffer(got["output1"], np.float32).reshape(()) == np.asarray(want[1])


def test_collectives_without_a_process_group_fail_the_execution(rt, tmp_path, monkeypatch, capfd):
    """A NEFF with collectives run where torch.distributed is not initialized, or whose groups name more ranks
    than the world has: NRT_FAILURE, with the reason on stderr (a collective is never run as the identity)."""
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    status, neff = compile_text(tmp_path, _lower(lambda x: _emit(x * 2, "all_reduce", [[0, 1]]) + 1, _f32(2, 3)))
    assert status == 0
    assert rt.init() == S["NRT_SUCCESS"]
    assert rt.run(neff, np.ones((2, 3), np.float32))[0] == S["NRT_FAILURE"]
    assert "torch.distributed.init_process_group" in capfd.readouterr().err


def test_collectives_naming_ranks_the_world_has_not_fail(tmp_path, monkeypatch, world_of_one):
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    status, neff = compile_text(tmp_path, _lower(lambda x: _emit(x, "all_gather", [[0, 1]]), _f32(2, 3)))
    assert status == 0
    with pytest.raises(Exception, match="names replica 1, but the process group has 1 ranks"):
        compute.execute(neff, {"input0": np.ones((2, 3), np.float32).tobytes()})


@pytest.mark.parametrize(
    "fn, edit, message",
    [
        (
            lambda x: lax.fori_loop(0, 2, lambda i, c: _emit(c, "all_reduce", [[0]]), x),
            None,
            "not at the top level of @main",
        ),
        (lambda x: _emit(x, "all_reduce", [[0]]), ("stablehlo.add", "stablehlo.subtract"), "reducer"),
    ],
    ids=["nested-in-a-loop", "unknown-reducer"],
)
def test_compiler_refuses_collectives_the_simulator_cannot_run(tmp_path, monkeypatch, capsys, fn, edit, message):
    monkeypatch.setenv("NRTSIM_STATE_DIR", str(tmp_path / "state"))
    text = _lower(fn, _f32(2, 3))
    if edit:
        assert edit[0] in text
        text = text.replace(edit[0], edit[1])
    status, _ = compile_text(tmp_path, text)
    err = capsys.readouterr().err
    assert status == 1 and "NCC_SIM005" in err and message in err, err


def test_collective_semantics_in_a_world_of_four():
    """Each rank's result, for groups listed out of rank order ([1, 0], [3, 2]): members in the listed order."""
    from tests.device_sim.collectives import Collective, semantics

    xs = [[np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * r] for r in range(4)]
    groups = ((1, 0), (3, 2))

    def each(c):
        return [semantics(c, r, 4, xs)[0] for r in range(4)]

    x = [a[0] for a in xs]
    for r, got in enumerate(each(Collective("all_reduce", 0, groups, reduce="sum"))):
        np.testing.assert_array_equal(got, x[r] + x[r ^ 1])
    for r, got in enumerate(each(Collective("all_reduce", 0, (), reduce="max"))):
        np.testing.assert_array_equal(got, x[3])
    for r, got in enumerate(each(Collective("all_gather", 0, groups, dim=1))):
        np.testing.assert_array_equal(got, np.concatenate([x[r | 1], x[r & ~1]], axis=1))
    for r, got in enumerate(each(Collective("reduce_scatter", 0, groups, reduce="sum", dim=0))):
        np.testing.assert_array_equal(got, (x[r] + x[r ^ 1])[[1 - r % 2]])  # rank 1 is first of [1, 0]
    for r, got in enumerate(
        each(Collective("all_to_all", 0, groups, split_dimension=1, concat_dimension=0, split_count=2))
    ):
        me = 1 - r % 2
        np.testing.assert_array_equal(got, np.concatenate([x[r | 1][:, [me]], x[r & ~1][:, [me]]], axis=0))
    for r, got in enumerate(each(Collective("collective_permute", 0, (), pairs=((0, 1), (1, 2), (2, 3))))):
        np.testing.assert_array_equal(got, x[r - 1] if r else np.zeros((2, 2), np.float32))
    for r, got in enumerate(each(Collective("collective_broadcast", 0, groups))):
        np.testing.assert_array_equal(got, x[r | 1])


# ------------------------------------------------------------------------------- python -m tests.device_sim
def test_command_line_switches_the_simulator_on(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(device_sim.REPO_ROOT), NRTSIM_STATE_DIR=str(tmp_path))
    exports = subprocess.run([sys.executable, "-m", "tests.device_sim", "--env"], capture_output=True, text=True,
                             env=env, cwd=tmp_path)  # fmt: skip
    assert exports.returncode == 0, exports.stderr
    names = [line.split("=", 1)[0] for line in exports.stdout.splitlines()]
    assert names == ["export NEURON_COMPILE_LIBNRT", "export PATH", "export PYTHONPATH", "export NRTSIM_STATE_DIR"]
    probe = 'test "$NEURON_COMPILE_LIBNRT" -ef "$(dirname "$(command -v neuronx-cc)")/../libnrt.so.1" && exit 7'
    run = subprocess.run([sys.executable, "-m", "tests.device_sim", "--", "sh", "-c", probe], env=env, cwd=tmp_path)
    assert run.returncode == 7
