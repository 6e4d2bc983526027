"""Op and Layer: the graph's nodes and their pass groups."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from torchlens.errors import AmbiguousOpLookupError, PayloadUnavailableError
from torchlens.records.collections import OwnedRecords
from torchlens.records.ports import port

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex32": 4,
}


def itemsize(dtype: str | None) -> int:
    """Bytes per element of a dtype name (framework prefixes such as `torch.` ignored)."""
    if not dtype:
        return 0
    return _ITEMSIZE.get(dtype.rsplit(".", 1)[-1], 0)


def numel(shape: tuple[int, ...] | None) -> int:
    if shape is None:
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Op:
    """One executed callable invocation: a node of the dataflow graph.

    `label` is unique (`relu_1_2`, `linear_1_1:2` for pass 2 of a multi-pass layer).
    Source ops (`input_1`, `buffer_1`, constants) have no op parents; `output_N` ops mark
    what the model returned.
    """

    __slots__ = (
        "label", "layer_label", "func_name", "kind", "index", "pass_number", "num_passes",
        "parents", "parent_slots", "children", "module", "modules", "module_calls", "params",
        "shapes", "dtypes", "multi_output", "path", "_outputs", "saved", "meta", "func",
        "args_template", "kwargs_template", "is_inplace", "_trace", "event_id", "grads",
        "type_num", "step_num", "site",
    )

    def __init__(self) -> None:
        self.children: list[str] = []
        self.grads: tuple[Any, ...] | None = None

    # payloads --------------------------------------------------------------------------
    @property
    def has_saved_out(self) -> bool:
        return self.saved

    @property
    def outs(self) -> tuple[Any, ...]:
        """Every output slot's value, as a tuple (one entry for a single-output op)."""
        if not self.saved:
            raise PayloadUnavailableError(
                "activation_not_saved",
                f"op {self.label!r} was captured without its payload",
                remedy=f"capture again with save='all' or save=[{self.label!r}] (or a selector that matches it)",
                label=self.label,
            )
        return self._outputs

    @property
    def out(self) -> Any:
        """The op's output: one value, or a tuple for a multi-output op."""
        outs = self.outs
        return outs if self.multi_output else outs[0]

    @out.setter
    def out(self, value: Any) -> None:
        """A direct write: bypasses the intervention recipe, so the trace is marked
        DIRECT_WRITE_DIRTY (warned once per trace); use `trace.do` for an auditable edit."""
        import warnings

        from torchlens.errors import TraceMutationWarning

        self._outputs = tuple(value) if self.multi_output else (value,)
        self.saved = True
        note_direct_write = port("note_direct_write")

        if note_direct_write(self._trace, self.label):
            warnings.warn(f"direct write to {self.label}.out bypasses the intervention recipe; the trace is now "
                          "DIRECT_WRITE_DIRTY (use trace.do for an auditable edit)", TraceMutationWarning, stacklevel=2)

    def replace_outputs(self, outs: tuple) -> None:
        """An engine's recomputed output values (replay, fast rerun): held as saved, with no
        direct-write mark (the intervention layer records the edit in its own audit)."""
        self._outputs = tuple(outs)
        self.saved = True

    def do(self, site: Any, edit: Any = None, /, **kwargs: Any) -> Any:
        """`Trace.do` on this op's trace (same signature: the site first, positional-only)."""
        return self._trace.do(site, edit, **kwargs)

    @property
    def grad(self) -> Any:
        """Gradient of the loss with respect to this op's output (after `trace.backward`)."""
        if self.grads is None:
            raise PayloadUnavailableError(
                "grad_not_saved",
                f"op {self.label!r} has no saved gradient",
                remedy="capture with CaptureOptions(backward_ready=True, save_grads=True) and call trace.backward(loss)",
                label=self.label,
            )
        return self.grads if self.multi_output else self.grads[0]

    @property
    def has_grad(self) -> bool:
        return self.grads is not None

    # metadata --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.shapes[0] if self.shapes else None

    @property
    def dtype(self) -> str | None:
        return self.dtypes[0] if self.dtypes else None

    @property
    def numel(self) -> int:
        return sum(numel(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        nb = self.meta.get("nbytes")
        if nb is not None:
            return nb
        return sum(numel(s) * itemsize(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def flops(self) -> int | None:
        return self.meta.get("flops")

    @property
    def macs(self) -> int | None:
        return self.meta.get("macs")

    @property
    def duration(self) -> float | None:
        return self.meta.get("duration_s")

    @property
    def is_source(self) -> bool:
        return self.kind in ("input", "buffer", "constant") or (self.kind == "op" and not self.parents)

    @property
    def is_compute(self) -> bool:
        return self.kind == "op"

    @property
    def parent_ops(self) -> list["Op"]:
        ops = self._trace.ops
        return [ops[p] for p in self.parents]

    @property
    def child_ops(self) -> list["Op"]:
        ops = self._trace.ops
        return [ops[c] for c in self.children]

    @property
    def layer(self) -> "Layer":
        return self._trace.layers[self.layer_label]

    @property
    def trace(self) -> "Trace":
        return self._trace

    def __repr__(self) -> str:
        where = f" in {self.module}" if self.module and self.module != "self" else ""
        shape = "x".join(str(d) for d in self.shape) if self.shape is not None else "?"
        saved = "" if self.saved else ", not saved"
        return f"<Op {self.label}: {self.func_name}{where}, shape ({shape}), {self.dtype}{saved}>"

    def _repr_html_(self) -> str:
        op_html = port("op_html")

        return op_html(self)


class Layer:
    """The ops that ran one place in the code: one per pass (`linear_1_1:1`, `:2`, ...).

    A single-pass Layer passes single-op reads (`.out`, `.shape`) through to its Op; a
    multi-pass Layer refuses them with `layer_pass_ambiguous`.
    """

    __slots__ = ("label", "func_name", "kind", "module", "modules", "_ops", "_trace", "type_num", "step_num")

    def __init__(self, label: str, func_name: str, kind: str, module: str | None, modules: tuple[str, ...]) -> None:
        self.label = label
        self.func_name = func_name
        self.kind = kind
        self.module = module
        self.modules = modules
        self.ops = []

    def do(self, site: Any, edit: Any = None, /, **kwargs: Any) -> Any:
        """`Trace.do` on this layer's trace (same signature: the site first, positional-only)."""
        return self._trace.do(site, edit, **kwargs)

    @property
    def ops(self) -> list[Op]:
        """This layer's ops, one per pass; also keyed: `layer.ops["relu_1_2:2"]`,
        `layer.ops["address:N"]` (only ops of this layer)."""
        return self._ops

    @ops.setter
    def ops(self, value: Any) -> None:
        self._ops = OwnedRecords(value, self)

    def _own_key(self, ops: list, key: str) -> Op:
        from torchlens.errors import LookupMissError

        op = self._trace.ops[key]  # the typed entry point's rule, with its typed refusals
        if not any(op is o for o in ops):
            raise LookupMissError("label_unknown", f"{key!r} names {op.label}, which is not a pass of layer {self.label}",
                                  remedy=f"use one of {', '.join(o.label for o in ops[:6])}", key=key)
        return op

    @property
    def num_passes(self) -> int:
        return len(self.ops)

    @property
    def passes(self) -> list[Op]:
        return list(self.ops)

    def pass_(self, n: int) -> Op:
        return self.ops[n - 1]

    def _single(self, what: str) -> Op:
        if len(self.ops) != 1:
            raise AmbiguousOpLookupError(
                "layer_pass_ambiguous",
                f"layer {self.label!r} ran {len(self.ops)} passes; .{what} needs one",
                remedy=f"read {self.label}:1 .. {self.label}:{len(self.ops)} or {self.label}:last",
                label=self.label,
                candidates=[o.label for o in self.ops],
            )
        return self.ops[0]

    @property
    def out(self) -> Any:
        return self._single("out").out

    @out.setter
    def out(self, value: Any) -> None:
        self._single("out").out = value

    @property
    def outs(self) -> Any:
        return self._single("outs").outs

    @property
    def shape(self):
        return self._single("shape").shape

    @property
    def dtype(self):
        return self._single("dtype").dtype

    @property
    def grad(self):
        return self._single("grad").grad

    # The rest of the single-op reads a first user expects on `trace["label"]` (a Layer):
    # they pass through to the one Op of a single-pass layer, like `.out` does.
    @property
    def flops(self):
        return self._single("flops").flops

    @property
    def macs(self):
        return self._single("macs").macs

    @property
    def duration(self):
        return self._single("duration").duration

    @property
    def meta(self):
        return self._single("meta").meta

    @property
    def saved(self) -> bool:
        return self._single("saved").saved

    @property
    def nbytes(self):
        return self._single("nbytes").nbytes

    @property
    def parents(self) -> list[str]:
        seen: dict[str, None] = {}
        for op in self.ops:
            for p in op.parents:
                seen.setdefault(self._trace.ops[p].layer_label, None)
        return list(seen)

    @property
    def children(self) -> list[str]:
        seen: dict[str, None] = {}
        for op in self.ops:
            for c in op.children:
                seen.setdefault(self._trace.ops[c].layer_label, None)
        return list(seen)

    @property
    def params(self) -> tuple[str, ...]:
        return self.ops[0].params if self.ops else ()

    @property
    def is_recurrent(self) -> bool:
        return len(self.ops) > 1

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __repr__(self) -> str:
        where = f" in {self.module}" if self.module and self.module != "self" else ""
        return f"<Layer {self.label}: {self.func_name}{where}, {self.num_passes} pass{'es' if self.num_passes != 1 else ''}>"

    def _repr_html_(self) -> str:
        layer_html = port("layer_html")

        return layer_html(self)
