"""Loading a JAX `.tlspec` never runs code (docs/guides/security.md).

A loaded JAX op is re-bound from its recorded primitive name and parameters
(`meta["primitive"]`, `meta["primitive_params"]`), through the closed primitive table only:
JAX's own data primitives, never the code-carrying ones (callbacks, jaxpr calls, control
flow, FFI targets, serialized modules). Each case edits a real saved trace as an attacker
would (digests recomputed), loads it, validates it, and checks the marker file never
appears and an op that cannot be re-bound refuses `opaque_op_not_replayable`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.errors import ArtifactError, TorchLensError  # noqa: E402
from torchlens.types import CallablePlaceholder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torchlens-core" / "tests"))
from security_artifacts import MARKER_NAME, cell, dct, exec_source, rewrite_records  # noqa: E402

OPAQUE = "opaque_op_not_replayable"
_W = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))


def _model(x):
    return jax.nn.relu(jnp.tanh(x @ _W) * 2.0).sum(-1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    trace = tl.trace(_model, jnp.ones((2, 4)))
    assert "tanh_1_3" in trace.labels and trace.validate_forward_pass()
    path = trace.save(tmp_path_factory.mktemp("jax") / "f.tlspec")
    assert tl.load(path).validate_forward_pass()  # the untouched artifact re-binds and validates
    return path


@pytest.fixture
def art(saved, tmp_path):
    dst = tmp_path / "f.tlspec"
    shutil.copytree(saved, dst)
    return dst


def _meta_entry(tables, label, key, value):
    row, i = cell(tables, "ops", label, "meta")
    pairs = row[i]["$dict"]
    for p in pairs:
        if p[0] == key:
            p[1] = value
            return
    pairs.append([key, value])


def _refuses(path, marker):
    loaded = tl.load(path)
    assert isinstance(loaded.ops["tanh_1_3"].func, CallablePlaceholder)
    for action in (loaded.validate_forward_pass, lambda: loaded._backend.validate(loaded)):
        try:
            action()
        except TorchLensError as exc:
            assert exc.code == OPAQUE, repr(exc)
        else:
            raise AssertionError("an opaque op was replayed")
    with pytest.raises(ArtifactError) as info:
        loaded.validate_forward_pass()
    assert info.value.code == OPAQUE and info.value.fields["label"] == "tanh_1_3"
    assert not marker.exists()
    return loaded, info.value


@pytest.mark.parametrize("name", [
    "exec", "builtins.exec", "os.system", "pure_callback", "io_callback", "debug_callback", "debug_print",
    "pjit", "jit", "closed_call", "cond", "while", "scan", "custom_jvp_call", "custom_vjp_call", "ffi_call",
    "call_exported", "shard_map", "jax._src.callback.pure_callback_p", "", "tanh ",
])
def test_primitive_names_outside_the_table_load_opaque(art, tmp_path, name):
    marker = tmp_path / MARKER_NAME

    def edit(t):
        _meta_entry(t, "tanh_1_3", "primitive", name)
        _meta_entry(t, "tanh_1_3", "primitive_params", dct(callback={"$callable": "builtins.exec"},
                                                         source=exec_source(marker)))

    rewrite_records(art, edit)
    loaded, err = _refuses(art, marker)
    assert err.code == OPAQUE and err.fields["label"] == "tanh_1_3"
    assert isinstance(loaded.ops["tanh_1_3"].func, CallablePlaceholder) and not marker.exists()


@pytest.mark.parametrize("param", [
    {"$callable": "builtins.exec"},
    {"$tuple": [1, {"$callable": "os.system"}]},
    dct(inner=[{"$callable": "jax.jit"}]),
    {"$unencodable": ["jax._src.core.ClosedJaxpr", "{ lambda ; a:f32[]. let  in (a,) }"]},
])
def test_primitive_params_holding_code_load_opaque(art, tmp_path, param):
    marker = tmp_path / MARKER_NAME
    rewrite_records(art, lambda t: _meta_entry(t, "tanh_1_3", "primitive_params", dct(accuracy=param)))
    loaded, err = _refuses(art, marker)
    assert err.code == OPAQUE and err.fields["label"] == "tanh_1_3"
    assert isinstance(loaded.ops["tanh_1_3"].func, CallablePlaceholder) and not marker.exists()


def test_literal_params_never_decode_to_callables(art, tmp_path):
    """`$literal` cells are rebuilt by the codec from closed vocabularies: an attribute name
    that would reach a class's methods, or a non-numeric dtype, refuses at load, typed."""
    for literal in (["jax.lax.Precision", "__init__"], ["jax.lax.Precision", "__class__"], ["numpy.dtype", "O"],
                    ["jax.PRNGImpl", "__builtins__"], ["builtins.exec", "x"]):
        rewrite_records(art, lambda t, lit=literal: _meta_entry(
            t, "tanh_1_3", "primitive_params", dct(accuracy={"$literal": lit})))
        with pytest.raises(ArtifactError) as info:
            tl.load(art)
        assert info.value.code == "record_schema_invalid"


def test_func_name_is_ignored_when_meta_names_a_table_primitive(art, tmp_path):
    """The op is rebuilt from the primitive table; a hostile `func` name is never resolved."""
    marker = tmp_path / MARKER_NAME

    def edit(t):
        row, i = cell(t, "ops", "tanh_1_3", "func")
        row[i] = {"$callable": "builtins.exec"}

    rewrite_records(art, edit)
    loaded = tl.load(art)
    func = loaded.ops["tanh_1_3"].func
    assert type(func).__name__ == "PrimitiveCall" and func.primitive.name == "tanh"
    assert loaded.validate_forward_pass()
    assert not marker.exists()


def test_the_primitive_table_is_closed():
    from torchlens_jax.backend import primitive_table

    table = primitive_table()
    for name in ("add", "tanh", "dot_general", "max", "reduce_sum", "exp", "conv_general_dilated", "random_bits"):
        assert table[name].name == name
    for name in ("pure_callback", "io_callback", "debug_callback", "pjit", "jit", "cond", "while", "scan",
                 "custom_jvp_call", "custom_vjp_call", "closed_call", "ffi_call", "call_exported"):
        assert name not in table
    assert all(not getattr(p, "call_primitive", False) and not getattr(p, "map_primitive", False)
               for p in table.values())


def test_a_recorded_callback_is_never_called_after_load(tmp_path):
    """A model whose pure_callback writes the marker: capture runs it (live code), the loaded
    trace refuses to replay it."""
    marker = tmp_path / MARKER_NAME

    def host(v):
        marker.write_text("callback ran")
        return np.asarray(v) * 2

    def model(x):
        y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.tanh(x))
        return y + 1.0

    trace = tl.trace(model, jnp.ones((3,), jnp.float32))
    assert marker.exists()
    marker.unlink()
    loaded = tl.load(trace.save(tmp_path / "cb.tlspec"))
    with pytest.raises(ArtifactError) as info:
        loaded.validate_forward_pass()
    assert info.value.code == OPAQUE
    assert not marker.exists()


def test_prng_names_resolve_only_through_the_closed_table(monkeypatch):
    """A PRNG implementation named by a file comes from the table copied from JAX's registry,
    never from a module lookup made with the file's string."""
    import importlib

    from torchlens_jax import codec as C

    table = C.prng_table()
    assert "threefry2x32" in table
    calls = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    dec = C.JaxCodec().decode_literal
    assert dec("jax.PRNGImpl", "threefry2x32") is table["threefry2x32"]
    assert dec("jax.PRNGImpl", "os.system") is None and dec("jax.PRNGImpl", "__class__") is None
    assert calls == []
