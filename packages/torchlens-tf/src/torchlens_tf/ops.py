"""Recorded TensorFlow ops as replayable callables.

An eager op callback sees each executed op as (op type, flat input tensors, flat attribute
tuple, output tensors). The backend records it as a call of `raw_op(op_type)` on the inputs
with the attributes as keywords; calling it executes the same kernel again
(`tensorflow.python.eager.execute.quick_execute`, the function eager ops run through) and,
under a `tf.GradientTape`, records its gradient as TensorFlow's own generated op wrappers do.
The table is closed: `raw_op(name)` exists for the op types TensorFlow registers only, which
is how a loaded trace gets its callables back (`TFBackend.resolve_callable`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import op_def_registry

#: the kernel entry point, bound at import: never the callback-running variant a capture installs
_QUICK_EXECUTE = execute.quick_execute


def op_type_name(op_type: Any) -> str:
    return op_type.decode() if isinstance(op_type, bytes) else str(op_type)


def normalize_attr(value: Any) -> Any:
    """An attribute value as a plain Python value a saved trace keeps (a dtype as its enum)."""
    if isinstance(value, tf.dtypes.DType):
        return int(value.as_datatype_enum)
    if isinstance(value, tf.TensorShape):
        return None if value.rank is None else [(-1 if d is None else int(d)) for d in value.as_list()]
    if isinstance(value, (list, tuple)):
        return [normalize_attr(v) for v in value]
    return value


def attrs_dict(flat: tuple) -> dict[str, Any]:
    """The callback's flat (name, value, name, value, ...) tuple as a dict (a repeated name,
    which the fast path sometimes passes, keeps its one value). The fast path passes `None`
    for an attribute left at its default: it is left out, and the kernel call fills the
    op definition's default, as it did at capture."""
    return {str(flat[i]): normalize_attr(flat[i + 1]) for i in range(0, len(flat), 2) if flat[i + 1] is not None}


def is_multi_output(op_def: Any) -> bool:
    """An op returns a tuple unless it has exactly one output argument that is no list."""
    outs = op_def.output_arg
    return not (len(outs) == 1 and not outs[0].number_attr and not outs[0].type_list_attr)


def num_outputs(op_def: Any, attrs: dict[str, Any]) -> int:
    n = 0
    for arg in op_def.output_arg:
        if arg.number_attr:
            n += int(attrs[arg.number_attr])
        elif arg.type_list_attr:
            n += len(attrs[arg.type_list_attr])
        else:
            n += 1
    return n


class RawOp:
    """`raw_op("MatMul")(a, b, transpose_a=False, ...)`: one TensorFlow kernel on flat inputs."""

    __slots__ = ("op_type", "op_def", "multi", "__name__", "__qualname__")

    def __init__(self, op_type: str, op_def: Any) -> None:
        self.op_type = op_type
        self.op_def = op_def
        self.multi = is_multi_output(op_def)
        self.__name__ = op_type
        self.__qualname__ = f"raw_op.{op_type}"

    def __call__(self, *inputs: Any, **attrs: Any) -> Any:
        flat_attrs = tuple(x for k, v in attrs.items() for x in (k, v))
        ins = [x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x) for x in inputs]
        outs = _QUICK_EXECUTE(self.op_type, num_outputs(self.op_def, attrs), ins, flat_attrs, context.context())
        if execute.must_record_gradient():
            execute.record_gradient(self.op_type, ins, flat_attrs, outs)
        return tuple(outs) if self.multi else outs[0]

    def __repr__(self) -> str:
        return f"raw_op({self.op_type!r})"

    def __reduce__(self) -> Any:
        return (raw_op, (self.op_type,))


_TABLE: dict[str, RawOp] = {}


def raw_op(op_type: str) -> RawOp | None:
    """The replayable callable of a registered op type (None for a name TensorFlow does not register)."""
    op = _TABLE.get(op_type)
    if op is None:
        op_def = op_def_registry.get(op_type)
        if op_def is None:
            return None
        op = _TABLE[op_type] = RawOp(op_type, op_def)
    return op


def snake(op_type: str) -> str:
    """`MatMul` -> `matmul`, `BiasAdd` -> `biasadd`: the op's name in labels."""
    return op_type.lower()


__all__ = ["RawOp", "raw_op", "attrs_dict", "normalize_attr", "op_type_name", "is_multi_output", "num_outputs", "snake"]
