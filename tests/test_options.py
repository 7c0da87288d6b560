"""Options and their environment variables: every value parsed by one parser per option, and anything
else a NeuronOptionsError naming the option, the value and what is accepted, before anything compiles."""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import neuron_compile
from neuron_compile import NeuronOptionsError, Options

from .util import root_cause

Fn = Callable[..., Any]


def _compile(fn: Fn, **options: Any) -> Fn:
    return torch.compile(fn, backend="neuron", dynamic=False, options=options or None)


@pytest.mark.parametrize(
    "name, value, parsed",
    [
        ("cache", False, False),
        ("cache", "0", False),
        ("cache", "no", False),
        ("cache", "OFF", False),
        ("cache", "False", False),
        ("cache", " yes ", True),
        ("strict", "1", True),
        ("strict", "false", False),
        ("trust_cache_dir", "0", False),
        ("trust_cache_dir", "on", True),
        ("allow_eager_fallback", True, True),
        ("cache_max_bytes", 0, 0),
        ("cache_max_bytes", 12345, 12345),
        ("cache_max_bytes", "500M", 500 * 2**20),
        ("cache_max_bytes", "10G", 10 * 2**30),
        ("cache_max_bytes", "1.5k", 1536),
        ("cache_max_bytes", "2GiB", 2 * 2**30),
        ("cache_max_bytes", None, None),
        ("cache_dir", "/tmp/x", "/tmp/x"),
        ("cache_dir", pathlib.Path("/tmp/y"), "/tmp/y"),
        ("debug_dir", pathlib.Path("/tmp/d"), "/tmp/d"),
        ("debug_dir", None, None),
        ("neuron_cc_flags", "--a -b 'c d'", ("--a", "-b", "c d")),
        ("neuron_cc_flags", ["--x", "--y=1"], ("--x", "--y=1")),
        ("neuron_cc_flags", (), ()),
        ("opt_level", 1, 1),
        ("opt_level", "3", 3),
        ("target", "cpu", "cpu"),
        ("generation", "trn3", "trn3"),
        ("cache_url_timeout", 2, 2.0),
        ("cache_url_timeout", "0.5", 0.5),
        ("cache_url_timeout", 3600, 3600.0),
        ("cache_hmac_key", "fleet-key", b"fleet-key"),
        ("cache_hmac_key", "clé", "clé".encode()),
        ("cache_hmac_key", b"\xff\x00raw", b"\xff\x00raw"),
        ("cache_hmac_key", None, None),
    ],
)
def test_option_values_are_parsed(name: str, value: Any, parsed: Any) -> None:
    assert getattr(Options.from_user({name: value}), name) == parsed


_BAD_OPTIONS = [
    ("cache", "maybe"),
    ("cache", 1),
    ("cache", None),
    ("strict", "nope"),
    ("trust_cache_dir", 0),
    ("allow_eager_fallback", "2"),
    ("cache_max_bytes", -5),
    ("cache_max_bytes", True),
    ("cache_max_bytes", 1.5),
    ("cache_max_bytes", "lots"),
    ("cache_max_bytes", "-5M"),
    ("cache_max_bytes", "5X"),
    ("cache_dir", 123),
    ("cache_dir", b"/tmp"),
    ("debug_dir", 1),
    ("neuron_cc_flags", 5),
    ("neuron_cc_flags", ["--a", 5]),
    ("neuron_cc_flags", "--a 'unclosed"),
    ("opt_level", 0),
    ("opt_level", 4),
    ("opt_level", "O2"),
    ("opt_level", True),
    ("opt_level", 2.0),
    ("target", "gpu"),
    ("generation", "trn1"),
    ("cache_dir", "/tmp/a\0b"),
    ("cache_dir", pathlib.Path("/tmp/a\0b")),
    ("debug_dir", "\0"),
    ("cache_url_timeout", float("inf")),
    ("cache_url_timeout", "inf"),
    ("cache_url_timeout", 1e308),
    ("cache_url_timeout", float("nan")),
    ("cache_url_timeout", 0),
    ("cache_url_timeout", -1),
    ("cache_url_timeout", 3601),
    ("cache_url_timeout", True),
    ("cache_url_timeout", "soon"),
]


@pytest.mark.parametrize("name, value", _BAD_OPTIONS)
def test_bad_option_value_is_a_clear_error(name: str, value: Any) -> None:
    with pytest.raises(NeuronOptionsError) as info:
        Options.from_user({name: value})
    msg = str(info.value)
    assert repr(name) in msg and repr(value) in msg and "expected" in msg, msg


_ENV = {
    "cache": "NEURON_COMPILE_CACHE",
    "strict": "NEURON_COMPILE_STRICT",
    "trust_cache_dir": "NEURON_COMPILE_CACHE_TRUST",
    "cache_max_bytes": "NEURON_COMPILE_CACHE_MAX_BYTES",
    "opt_level": "NEURON_COMPILER_OPT_LEVEL",
    "neuron_cc_flags": "NEURON_CC_FLAGS",
    "target": "NEURON_COMPILE_TARGET",
    "generation": "NEURON_COMPILE_GENERATION",
}


@pytest.mark.parametrize(
    "name, raw, parsed",
    [
        ("cache", "no", False),
        ("cache", "TRUE", True),
        ("strict", "off", False),
        ("trust_cache_dir", "0", False),
        ("cache_max_bytes", "500M", 500 * 2**20),
        ("opt_level", "1", 1),
        ("neuron_cc_flags", "--a --b", ("--a", "--b")),
        ("generation", "trn3", "trn3"),
    ],
)
def test_env_vars_use_the_same_parser(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, parsed: Any) -> None:
    monkeypatch.setenv(_ENV[name], raw)
    assert getattr(Options.from_user(None), name) == parsed


@pytest.mark.parametrize(
    "name, raw",
    [
        ("cache", "maybe"),
        ("strict", "2"),
        ("trust_cache_dir", "y"),
        ("cache_max_bytes", "-1"),
        ("opt_level", "9"),
        ("target", "tpu"),
    ],
)
def test_bad_env_var_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, name: str, raw: str) -> None:
    monkeypatch.setenv(_ENV[name], raw)
    with pytest.raises(NeuronOptionsError) as info:
        Options.from_user(None)
    assert f"{_ENV[name]}={raw!r}" in str(info.value) and repr(name) in str(info.value)


@pytest.mark.parametrize("options", [42, "abc", ["cache"], ("target", "cpu"), 1.5])
def test_options_that_are_not_a_dict_are_a_clear_error(options: Any) -> None:
    # used to be TypeError: 'int' object is not iterable / ValueError: dictionary update sequence...
    with pytest.raises(BackendCompilerFailed) as info:
        torch.compile(lambda x: x + 1, backend="neuron", options=options)(torch.zeros(2))
    err = root_cause(info.value)
    assert isinstance(err, NeuronOptionsError), repr(err)
    assert f"options={options!r}" in str(err) and "expected a dict" in str(err)


def test_unknown_option_keys_of_any_type_are_named() -> None:
    with pytest.raises(NeuronOptionsError, match=r"unknown option\(s\) \['nope', 1\]"):
        Options.from_user({1: True, "nope": 2, "cache": True})


@pytest.mark.parametrize("name", ["cache_dir", "debug_dir"])
def test_path_with_a_nul_byte_fails_before_compiling(name: str) -> None:
    # used to be a raw ValueError: embedded null byte, from the first os call on it
    with pytest.raises(BackendCompilerFailed) as info:
        _compile(lambda x: x + 1, **{name: "/tmp/neuron\0cache"})(torch.zeros(2))
    err = root_cause(info.value)
    assert isinstance(err, NeuronOptionsError) and repr(name) in str(err) and "NUL" in str(err), repr(err)


@pytest.mark.parametrize("raw", ["inf", "1e308", "nan", "-inf", "0", "-3", "3601", "soon"])
def test_remote_timeout_env_is_bounded_and_finite(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # "inf" used to reach the remote cache and fail torch.compile with OverflowError: timestamp out of range
    from neuron_compile.cache.remote import timeout_from_env

    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL_TIMEOUT", raw)
    expected = f"NEURON_COMPILE_CACHE_URL_TIMEOUT={raw!r}.*'cache_url_timeout'.*seconds > 0 and <= 3600"
    with pytest.raises(NeuronOptionsError, match=expected):
        Options.from_user(None)
    with pytest.raises(NeuronOptionsError, match=expected):
        timeout_from_env()
    with pytest.raises(BackendCompilerFailed) as info:
        _compile(lambda x: x + 1)(torch.zeros(2))
    assert isinstance(root_cause(info.value), NeuronOptionsError)


def test_remote_timeout_env_default_and_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_compile.cache.remote import timeout_from_env

    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL_TIMEOUT", raising=False)
    assert Options.from_user(None).cache_url_timeout == timeout_from_env() == 10.0
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL_TIMEOUT", " 2.5 ")
    assert Options.from_user(None).cache_url_timeout == timeout_from_env() == 2.5
    assert Options.from_user({"cache_url_timeout": 7}).cache_url_timeout == 7.0  # the option beats the variable


def test_hmac_key_env_that_is_not_utf8_is_a_clear_error_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # bytes that are not UTF-8 reach os.environ as lone surrogates: key.encode() was a raw UnicodeEncodeError
    from neuron_compile.cache.remote import hmac_key_from_env

    monkeypatch.setenv("NEURON_COMPILE_CACHE_HMAC_KEY", "s3cr\udcffet")
    for call in (lambda: Options.from_user(None), hmac_key_from_env):
        with pytest.raises(NeuronOptionsError) as info:
            call()
        msg = str(info.value)
        assert "NEURON_COMPILE_CACHE_HMAC_KEY" in msg and "'cache_hmac_key'" in msg and "valid text" in msg, msg
        assert "s3cr" not in msg, "the key must not be shown"


def test_hmac_key_env_is_read_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_compile.cache.remote import hmac_key_from_env

    monkeypatch.setenv("NEURON_COMPILE_CACHE_HMAC_KEY", "the-fleet-key")
    opts = Options.from_user(None)
    assert opts.cache_hmac_key == hmac_key_from_env() == b"the-fleet-key"
    assert "the-fleet-key" not in repr(opts)
    with pytest.raises(NeuronOptionsError) as info:
        Options.from_user({"cache_hmac_key": 12345})
    assert "12345" not in str(info.value) and "'cache_hmac_key'" in str(info.value)


def test_explicit_option_beats_bad_free_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_COMPILE_CACHE", "0")
    assert Options.from_user({"cache": True}).cache is True
    assert Options.from_user(None).cache is False


def test_string_false_really_disables_through_torch_compile() -> None:
    # "0"/"false" used to be truthy strings: the cache was used although the user turned it off.
    neuron_compile.STATS.reset()
    fn = _compile(lambda x: x * 3 + 1, cache="false")
    torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), 4.0))
    assert [g.cache for g in neuron_compile.STATS.graphs] == ["off"], neuron_compile.STATS.graphs


def test_bad_option_fails_before_compiling() -> None:
    with pytest.raises(BackendCompilerFailed) as info:
        _compile(lambda x: x + 1, cache_max_bytes="500Q")(torch.zeros(2))
    err = root_cause(info.value)
    assert isinstance(err, NeuronOptionsError) and "cache_max_bytes" in str(err)


def test_the_logical_core_size_is_read_from_either_runtime_variable(monkeypatch) -> None:
    """NEURON_RT_VIRTUAL_CORE_SIZE (TorchNeuron's docs) as well as NEURON_LOGICAL_NC_CONFIG; disagreeing: refused."""
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("NEURON_RT_VIRTUAL_CORE_SIZE", "1")
    assert Options.from_user({"target": "cpu"}).lnc == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert Options.from_user({"target": "cpu"}).lnc == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(
        NeuronOptionsError, match="NEURON_LOGICAL_NC_CONFIG=2 and NEURON_RT_VIRTUAL_CORE_SIZE=1 disagree"
    ):
        Options.from_user({"target": "cpu"})
    assert Options.from_user({"target": "cpu", "lnc": 2}).lnc == 2  # an explicit option decides
    monkeypatch.setenv("NEURON_RT_VIRTUAL_CORE_SIZE", "3")
    with pytest.raises(NeuronOptionsError, match="NEURON_RT_VIRTUAL_CORE_SIZE"):
        Options.from_user({"target": "cpu"})
