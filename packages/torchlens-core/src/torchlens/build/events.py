"""The raw event stream a backend emits during one capture.

A backend never builds records itself: it describes the model once (`ModelInfo`) and then
appends events in execution order to an `EventLog`. Core's builder (`torchlens.build.builder`)
turns the log into a `Trace`: labels, pass grouping, the module tree and graph edges are
computed there, once, for every backend, so every backend's traces read the same.

Payloads stay framework-native: core never looks inside a value except through the
backend's value members (`is_tensor`, `host_copy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

#: Kinds of op events. Source kinds have no parents produced by other ops.
OP_KINDS = ("input", "buffer", "constant", "op", "output")


@dataclass(slots=True)
class ModuleInfo:
    """One module of the model, described before the forward runs.

    `address` is the canonical dotted name (`"encoder.layer.0"`); the root is `"self"`.
    """

    address: str
    class_name: str
    class_qualname: str = ""
    parent: str | None = None
    all_addresses: tuple[str, ...] = ()
    training: bool = False


@dataclass(slots=True)
class ParamInfo:
    """One registered parameter (`address` like `"fc.weight"`, owned by `module`)."""

    address: str
    module: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    value: Any = None
    device: str = "cpu"
    aliases: tuple[str, ...] = ()  # the other addresses of a tied parameter (module paths)


@dataclass(slots=True)
class BufferInfo:
    """One registered (or module-held) buffer, addressed like a parameter."""

    address: str
    module: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    value: Any = None
    persistent: bool = True
    device: str = "cpu"


@dataclass(slots=True)
class ModelInfo:
    """Static description of the traced model: module tree, parameters, buffers."""

    root_class: str
    modules: list[ModuleInfo] = field(default_factory=list)
    params: list[ParamInfo] = field(default_factory=list)
    buffers: list[BufferInfo] = field(default_factory=list)


@dataclass(slots=True)
class OpEvent:
    """One recorded operation, or a source (input / buffer / constant) or an output leaf.

    - `id`: unique within the log, increasing in execution order.
    - `kind`: one of `OP_KINDS`.
    - `func_name`: the callable's short name (`"linear"`, `"relu"`, `"__add__"` may be
      normalised by the backend to `"add"`); sources use `"input"`, `"buffer"`,
      `"constant"`, outputs `"output"`. Literal producers (`zeros`, `arange`) keep their
      own name with kind `"op"` and no parents.
    - `parents`: `(event id, output slot)` pairs in argument order; slot is 0 for
      single-output ops.
    - `outputs`: the produced values, one per output slot (framework-native). A value the
      capture did not save is `None` with `saved=False`; shapes and dtypes are kept anyway.
    - `module_stack`: `(address, call number)` pairs, outermost first, starting with the
      root `("self", n)`; empty for inputs and outputs, which sit outside every module.
    - `site`: a hashable call-site key (where in the code the call happened). Pass grouping
      uses (innermost module address, site, func_name): the same place run again is a
      new pass of one Layer; two places are two Layers.
    - `params`: parameter addresses the op read directly.
    - `path`: for inputs the input path (`"x"`, `"args[1]"`, `"kwargs['mask']"`), for
      buffers the buffer address, for outputs the path in the returned structure.
    - `func`, `args_template`: what replay needs (the callable and its arguments with
      tensors replaced by `ArgRef`s); optional.
    - `meta`: backend extras (flops, macs, duration_s, rng_state, is_inplace, ...).
    """

    id: int
    kind: str
    func_name: str
    parents: tuple[tuple[int, int], ...] = ()
    outputs: tuple[Any, ...] = ()
    shapes: tuple[tuple[int, ...] | None, ...] = ()
    dtypes: tuple[str | None, ...] = ()
    module_stack: tuple[tuple[str, int], ...] = ()
    site: Hashable = None
    params: tuple[str, ...] = ()
    path: str | None = None
    saved: bool = True
    multi_output: bool = False
    func: Any = None
    args_template: Any = None
    kwargs_template: Any = None
    is_inplace: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ModuleEnter:
    """A module call started. `call` is 1-based per module address."""

    address: str
    call: int
    input_ids: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class ModuleExit:
    """A module call ended; `output_ids` name the ops whose values it returned."""

    address: str
    call: int
    output_ids: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ArgRef:
    """Stands for a tensor argument inside an argument template: the parent at `index`
    in the op's `parents`, or a parameter/buffer by `address`."""

    index: int = -1
    address: str | None = None


def fill_template(template: Any, fill: Any) -> Any:
    """An argument template with each `ArgRef` replaced by `fill(ref)` (tuples, lists and
    dicts rebuilt; every other literal kept as recorded)."""
    if isinstance(template, ArgRef):
        return fill(template)
    if type(template) is tuple:
        return tuple(fill_template(t, fill) for t in template)
    if type(template) is list:
        return [fill_template(t, fill) for t in template]
    if type(template) is dict:
        return {k: fill_template(v, fill) for k, v in template.items()}
    return template


class EventLog:
    """An append-only list of events with an id counter. Backends own one per capture."""

    __slots__ = ("events", "_next_id")

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._next_id = 0

    def new_id(self) -> int:
        i = self._next_id
        self._next_id = i + 1
        return i

    def append(self, event: Any) -> None:
        self.events.append(event)
