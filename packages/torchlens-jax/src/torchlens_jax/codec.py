"""The JAX payload codec: jax.Array <-> core's neutral `EncodedPayload`, bit-exact.

Every dtype travels as its exact bytes in a NumPy array of the same item size, tagged with
the neutral dtype name (bfloat16 and the float8 types as unsigned integers). Typed PRNG key
arrays travel as their raw key data with the key implementation in `meta["prng_impl"]`, and
come back as typed keys. Loaded arrays are placed on JAX's default device (the saved device
is in `meta["device"]`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchlens.backends.sdk import ArtifactError, EncodedPayload

_PLAIN = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"}
#: ml_dtypes types carried as same-size unsigned integers.
_VIEWED = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def _is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


class JaxCodec:
    """`PayloadCodec` for jax.Array payloads (any dtype core has a tag for, and typed keys)."""

    name = "jax"

    def can_encode(self, value: Any) -> bool:
        if not isinstance(value, jax.Array):
            return False
        if _is_key(value):
            return True
        return str(value.dtype) in _PLAIN or str(value.dtype) in _VIEWED

    def encode(self, value: Any) -> EncodedPayload:
        meta = {"device": _device(value)}
        if _is_key(value):
            meta["prng_impl"] = str(jax.random.key_impl(value))
            meta["key_shape"] = ",".join(str(d) for d in value.shape)
            value = jax.random.key_data(value)
        arr = np.asarray(value)
        tag = str(arr.dtype)
        if tag in _VIEWED:
            arr = arr.view(_VIEWED[tag])
        return EncodedPayload(arr, tag, tuple(int(d) for d in arr.shape), meta)

    def encode_literal(self, value: Any) -> tuple[str, Any] | None:
        """JAX literals in primitive parameters, as (kind, plain value)."""
        if isinstance(value, np.dtype):
            return "numpy.dtype", value.name
        tname = type(value).__name__
        if tname in ("TypedInt", "TypedFloat", "TypedComplex") and hasattr(value, "dtype"):
            base = {"TypedInt": int, "TypedFloat": float, "TypedComplex": complex}[tname](value)
            plain = (base.real, base.imag) if tname == "TypedComplex" else base
            return "jax." + tname, (np.dtype(value.dtype).name, plain)
        if tname == "TypedNdArray" and isinstance(value, np.ndarray):
            # a literal operand of an equation (weakly typed scalars such as the 0 of relu)
            arr = np.asarray(value)
            bits = arr.view(_VIEWED.get(arr.dtype.name, arr.dtype)).tolist()
            return "jax.TypedNdArray", (arr.dtype.name, bool(value.weak_type), tuple(arr.shape), bits)
        from jax import lax

        if isinstance(value, lax.ConvDimensionNumbers):
            return "jax.lax.ConvDimensionNumbers", tuple(tuple(int(d) for d in spec) for spec in value)
        for kind, cls in _DIMENSION_NUMBERS.items():
            if type(value) is getattr(lax, cls):
                return kind, tuple(tuple(int(d) for d in field) for field in value)
        if isinstance(value, (lax.GatherScatterMode, lax.FftType)):
            return f"jax.lax.{type(value).__name__}", value.name
        combiner = _scatter_combiner(value)
        if combiner is not None:
            return "jax.ScatterCombiner", combiner
        if type(value).__name__ == "PRNGImpl" and hasattr(value, "name"):
            return "jax.PRNGImpl", str(value.name)
        if isinstance(value, lax.Precision):
            return "jax.lax.Precision", value.name
        return None

    def decode_literal(self, kind: str, plain: Any) -> Any:
        """The literal, or None when `plain` is not one (the loader then refuses it, typed).
        Dtype names are checked against the numeric ones before numpy sees them, and an
        array literal's element count against its shape before anything is allocated."""
        try:
            return self._literal(kind, plain)
        except (TypeError, ValueError, OverflowError, KeyError, AttributeError):
            return None

    def _literal(self, kind: str, plain: Any) -> Any:
        from jax import lax

        if kind == "numpy.dtype" and isinstance(plain, str):
            return _numeric_dtype(plain)
        if kind in ("jax.TypedInt", "jax.TypedFloat", "jax.TypedComplex") and isinstance(plain, tuple) and len(plain) == 2:
            from jax._src import literals

            name, v = plain
            dtype = _numeric_dtype(name)
            want = {"jax.TypedInt": (int,), "jax.TypedFloat": (float,), "jax.TypedComplex": (tuple,)}[kind]
            if dtype is None or type(v) not in want or (kind == "jax.TypedComplex" and not (
                    len(v) == 2 and all(type(x) is float for x in v))):
                return None
            kinds = {"jax.TypedInt": "iub", "jax.TypedFloat": "f", "jax.TypedComplex": "c"}[kind]
            if dtype.kind not in kinds and not (kind == "jax.TypedFloat" and dtype.name in _VIEWED):
                return None  # bfloat16 and the float8 types are floats numpy calls kind "V"
            if dtype.kind in "iu" and not np.iinfo(dtype).min <= v <= np.iinfo(dtype).max:
                return None  # a value its dtype cannot hold
            cls = getattr(literals, kind.rpartition(".")[2])
            return cls(complex(*v) if kind == "jax.TypedComplex" else v, dtype)
        if kind == "jax.TypedNdArray" and isinstance(plain, tuple) and len(plain) == 4:
            import ml_dtypes  # noqa: F401  (bfloat16 and float8 names)
            from jax._src.core import ShapedArray
            from jax._src.literals import TypedNdArray

            name, weak, shape, bits = plain
            dtype = _numeric_dtype(name)
            if (dtype is None or type(weak) is not bool or not isinstance(shape, tuple)
                    or not all(type(d) is int and d >= 0 for d in shape)
                    or int(np.prod(shape, dtype=object)) != _leaf_count(bits)):
                return None  # the element count must match before numpy allocates anything
            arr = np.asarray(bits, dtype=_VIEWED.get(name, dtype)).view(dtype).reshape(shape)
            return TypedNdArray(arr, ShapedArray(arr.shape, arr.dtype, weak_type=bool(weak)))
        if (kind == "jax.lax.ConvDimensionNumbers" and isinstance(plain, tuple) and len(plain) == 3
                and all(isinstance(s, tuple) and all(type(d) is int for d in s) for s in plain)):
            return lax.ConvDimensionNumbers(*plain)
        if kind in _DIMENSION_NUMBERS and isinstance(plain, tuple):
            cls = getattr(lax, _DIMENSION_NUMBERS[kind])
            if len(plain) != len(cls._fields) or not all(
                    isinstance(f, tuple) and all(type(d) is int and 0 <= d < 64 for d in f) for f in plain):
                return None
            return cls(*plain)
        if kind in ("jax.lax.GatherScatterMode", "jax.lax.FftType") and isinstance(plain, str):
            enum = getattr(lax, kind.rpartition(".")[2])
            return enum[plain] if plain in enum.__members__ else None
        if kind == "jax.ScatterCombiner" and isinstance(plain, tuple) and len(plain) == 2:
            return _combiner_jaxpr(*plain)
        if kind == "jax.PRNGImpl" and isinstance(plain, str):
            return prng_table().get(plain)
        if kind == "jax.lax.Precision" and isinstance(plain, str) and plain in lax.Precision.__members__:
            return lax.Precision[plain]
        return None

    def decode(self, payload: EncodedPayload) -> Any:
        """The array `payload` holds; its metadata is checked first (known keys, a known
        PRNG implementation whose key shape matches), `payload_meta_invalid` otherwise."""
        _check_meta(payload)
        arr = np.asarray(payload.array)
        if payload.dtype in _VIEWED:
            import ml_dtypes

            arr = arr.view(getattr(ml_dtypes, payload.dtype))
        else:
            arr = arr.view(np.dtype(payload.dtype))
        arr = arr.reshape(payload.shape)
        out = jax.numpy.asarray(arr)
        impl = payload.meta.get("prng_impl")
        if impl:
            out = jax.random.wrap_key_data(out, impl=impl)
        return out


#: Literal kind -> the `jax.lax` NamedTuple of gather / scatter dimension numbers.
_DIMENSION_NUMBERS = {"jax.lax.GatherDimensionNumbers": "GatherDimensionNumbers",
                      "jax.lax.ScatterDimensionNumbers": "ScatterDimensionNumbers"}
#: The combining primitive of a scatter's `update_jaxpr` (what `lax.scatter_add` and friends build).
_COMBINERS = ("add", "mul", "min", "max")


def _scatter_combiner(value: Any) -> tuple[str, str] | None:
    """(primitive, dtype) when `value` is the two-scalar, one-equation jaxpr a scatter
    reduction carries (`{ lambda ; a b. let c = add a b in (c,) }`); None for anything else."""
    if type(value).__name__ != "Jaxpr" or not hasattr(value, "eqns"):
        return None
    try:
        (eqn,) = value.eqns
        a, b = value.invars
        (out,) = value.outvars
        if (value.constvars or eqn.primitive.name not in _COMBINERS or eqn.params or list(eqn.invars) != [a, b]
                or list(eqn.outvars) != [out] or a.aval.shape != () or a.aval.dtype != b.aval.dtype):
            return None
        return eqn.primitive.name, np.dtype(a.aval.dtype).name
    except (ValueError, TypeError, AttributeError):
        return None


def _combiner_jaxpr(prim: Any, dtype_name: Any) -> Any:
    """The scatter `update_jaxpr` for a combiner a file names: rebuilt by tracing the fixed
    `jax.lax` function (never code from the file)."""
    dtype = _numeric_dtype(dtype_name)
    if prim not in _COMBINERS or dtype is None:
        return None
    from jax import lax

    fn = {"add": lax.add, "mul": lax.mul, "min": lax.min, "max": lax.max}[prim]
    scalar = jax.ShapeDtypeStruct((), dtype)
    return jax.make_jaxpr(fn)(scalar, scalar).jaxpr


_META_KEYS = {"device", "prng_impl", "key_shape"}
_NUMERIC = _PLAIN | set(_VIEWED)


def _leaf_count(bits: Any) -> int | None:
    """Number of scalars in an array literal's nested `tolist()` form (a 0-d array's is one
    scalar), or None when it holds anything else."""
    if type(bits) in (int, float, bool):
        return 1
    if type(bits) is not list:
        return None
    total = 0
    for b in bits:
        n = _leaf_count(b)
        if n is None:
            return None
        total += n
    return total


def _numeric_dtype(name: Any) -> Any:
    """np.dtype(name) for the numeric dtype names the codec writes; None for anything else
    (numpy parses far more: record, void and sub-array dtypes that allocate per element)."""
    if type(name) is not str or name not in _NUMERIC:
        return None
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

    return np.dtype(name)


def _bad_meta(why: str, meta: Any) -> ArtifactError:
    return ArtifactError("payload_meta_invalid", f"jax payload metadata {why}",
                         remedy="the artifact was modified or damaged; save it again", meta=repr(meta)[:200])


_PRNG_TABLE: dict[str, Any] | None = None


def prng_table() -> dict[str, Any]:
    """The closed table of PRNG implementations a file may name: JAX's registered
    `PRNGImpl` objects by name, copied once from its registry (a fixed import, never a
    module or attribute named by the file)."""
    global _PRNG_TABLE
    if _PRNG_TABLE is None:
        from jax._src.random import prng as _prng

        _PRNG_TABLE = {name: impl for name, impl in dict(_prng.prngs).items()
                       if type(name) is str and isinstance(impl, _prng.PRNGImpl)}
    return _PRNG_TABLE


def _check_meta(payload: EncodedPayload) -> None:
    meta = payload.meta
    if not isinstance(meta, dict) or not set(meta) <= _META_KEYS or not all(type(v) is str for v in meta.values()):
        raise _bad_meta(f"has keys other than {sorted(_META_KEYS)} or non-text values", meta)
    if ("prng_impl" in meta) != ("key_shape" in meta):
        raise _bad_meta("names a PRNG implementation without a key shape (or the reverse)", meta)
    if "prng_impl" not in meta:
        return
    impl = prng_table().get(meta["prng_impl"])
    if impl is None:
        raise _bad_meta(f"names PRNG implementation {meta['prng_impl'][:40]!r}, which this jax lacks", meta)
    key_shape = ",".join(str(d) for d in payload.shape[:len(payload.shape) - len(impl.key_shape)])
    if (payload.dtype != "uint32" or tuple(payload.shape[len(payload.shape) - len(impl.key_shape):]) != tuple(impl.key_shape)
            or key_shape != meta["key_shape"]):
        raise _bad_meta(f"key data of shape {payload.shape} is not {meta['prng_impl']} key data", meta)


def _device(value: Any) -> str:
    try:
        return str(next(iter(value.devices())))
    except Exception:  # noqa: BLE001 - tracers and deleted arrays have no device
        return "cpu"
