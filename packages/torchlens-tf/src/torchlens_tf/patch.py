"""What a capture changes in the framework, and how it is put back.

- one eager op callback (`tensorflow.python.framework.op_callbacks.add_op_callback`): TensorFlow
  calls it after every eagerly executed op with the op type, the input tensors, the attributes
  and the output tensors (installing the first callback also switches
  `tensorflow.python.eager.execute.execute` to its callback-running variant);
- `tf.config.run_functions_eagerly(True)`, so a `tf.function` runs its Python body op by op
  (each op is then executed eagerly and seen by the callback) instead of one graph call;
- `__call__` of the Keras classes the model's layers use (each class defining `__call__` in
  their MROs: `keras.layers.Layer`, `keras.Operation`, a user override), for module scopes;
- `pywrap_tfe.TFE_Py_FastPathExecute`, the entry point of TensorFlow's generated op wrappers:
  handed a `tf.Variable` as an op input, the C++ fast path reads it with a `ReadVariableOp`
  that runs no op callback, so the value would reach the op with no producer. During a capture
  such a variable is read through Python first (`read_variables`), which the callback sees,
  so the value is the parameter it is.

`Patches.install()` makes every change and `Patches.restore()` undoes them in reverse order;
the capture runs the forward in a `try`/`finally`, so a forward that raises leaves nothing
patched. `Patches.originals` lists every replaced object, so a test can check identity.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import execute
from tensorflow.python.framework import op_callbacks, op_def_registry
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

_RESOURCE = 20  # DT_RESOURCE: an input that takes the variable's handle itself


class _Active(threading.local):
    recorder: Any = None


ACTIVE = _Active()


def read_variables(op_name: Any, rest: tuple) -> tuple:
    """The fast path's arguments after (ctx, op name, name) with every `tf.Variable` given for a
    non-resource input read through Python (`v.value()`, a `ReadVariableOp` the callback sees)."""
    op_def = op_def_registry.get(op_name.decode() if isinstance(op_name, bytes) else op_name)
    if op_def is None:
        return rest
    out = None
    for i, arg in enumerate(op_def.input_arg[:len(rest)]):
        v = rest[i]
        if arg.type == _RESOURCE:
            continue
        if isinstance(v, BaseResourceVariable):
            new: Any = v.value()
        elif isinstance(v, (list, tuple)) and any(isinstance(x, BaseResourceVariable) for x in v):
            new = [x.value() if isinstance(x, BaseResourceVariable) else x for x in v]
        else:
            continue
        if out is None:
            out = list(rest)
        out[i] = new
    return rest if out is None else tuple(out)


def _fast_path(original: Callable[..., Any]) -> Callable[..., Any]:
    def TFE_Py_FastPathExecute(ctx: Any, op_name: Any, name: Any, *rest: Any) -> Any:
        rec = ACTIVE.recorder
        if rec is not None and not rec.busy:
            rest = read_variables(op_name, rest)
        return original(ctx, op_name, name, *rest)

    TFE_Py_FastPathExecute.__torchlens_original__ = original  # type: ignore[attr-defined]
    return TFE_Py_FastPathExecute


class Patches:
    """The patched framework for one capture."""

    def __init__(self, module_classes: list[type], module_call: Callable[[Any], Any], callback: Callable[..., Any]) -> None:
        self.originals: list[tuple[Any, str, Any]] = []
        self.module_classes = module_classes
        self.module_call = module_call
        self.callback = callback
        self._callback_added = False
        self._eager_before: bool | None = None

    def install(self) -> None:
        try:
            self.originals.append((execute, "execute", execute.execute))
            original_fast = pywrap_tfe.TFE_Py_FastPathExecute
            self.originals.append((pywrap_tfe, "TFE_Py_FastPathExecute", original_fast))
            pywrap_tfe.TFE_Py_FastPathExecute = _fast_path(original_fast)
            self._eager_before = bool(tf.config.functions_run_eagerly())
            tf.config.run_functions_eagerly(True)
            for cls in self.module_classes:
                original = cls.__dict__["__call__"]
                self.originals.append((cls, "__call__", original))
                setattr(cls, "__call__", self.module_call(original))
            op_callbacks.add_op_callback(self.callback)
            self._callback_added = True
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        if self._callback_added:
            op_callbacks.remove_op_callback(self.callback)
            self._callback_added = False
        if self._eager_before is not None:
            tf.config.run_functions_eagerly(self._eager_before)
            self._eager_before = None
        while self.originals:
            owner, name, original = self.originals.pop()
            setattr(owner, name, original)


def defining_classes(layers: list[Any]) -> list[type]:
    """The classes whose `__call__` runs for `layers` (each class defining `__call__` in their
    MROs), each once."""
    seen: list[type] = []
    for layer in layers:
        for c in type(layer).__mro__:
            if c is object:
                break
            if "__call__" in c.__dict__ and c not in seen:
                seen.append(c)
    return seen


def framework_state() -> dict[str, Any]:
    """What a capture may change, read now (tests compare it before and after)."""
    from tensorflow.python.eager import context

    return {"execute": execute.execute, "fast_path": pywrap_tfe.TFE_Py_FastPathExecute,
            "op_callbacks": tuple(context.context().op_callbacks),
            "functions_run_eagerly": bool(tf.config.functions_run_eagerly())}
