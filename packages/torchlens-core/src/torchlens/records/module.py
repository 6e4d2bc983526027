"""Module, ModuleCall, Param and Buffer records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchlens.records.collections import OwnedRecords
from torchlens.records.op import numel as _numel
from torchlens.records.ports import port

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op


def _distinct(records: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    for rec in records:
        if id(rec) not in seen:
            seen.add(id(rec))
            out.append(rec)
    return out


class ModuleCall:
    """One call of a module (`"encoder:2"`): the ops it ran, including nested modules'."""

    __slots__ = ("label", "address", "call", "op_labels", "input_labels", "output_labels", "_trace")

    def __init__(self, address: str, call: int) -> None:
        self.address = address
        self.call = call
        self.label = f"{address}:{call}"
        self.op_labels: list[str] = []
        self.input_labels: list[str] = []
        self.output_labels: list[str] = []

    @property
    def ops(self) -> list["Op"]:
        return [self._trace.ops[label] for label in self.op_labels]

    @property
    def output_ops(self) -> list["Op"]:
        return [self._trace.ops[label] for label in self.output_labels]

    @property
    def output_slots(self) -> list[tuple[str, int | None]]:
        """(op label, output slot) per tensor the call returned, in return order: a router
        returning `topk(...)[1]` gives `[("topk_1_5", 1)]`, not the whole pair. The slot is
        None where the label stands for its op's whole output."""
        ann = getattr(self._trace, "annotations", None) or {}
        slots = (ann.get("module_output_slots") or {}).get(self.label)
        if slots is None:
            return [(label, None) for label in self.output_labels]
        return [(str(label), int(slot)) for label, slot in slots]

    @property
    def out(self) -> Any:
        """The value the call returned: one tensor, or a tuple in return order (each output
        slot as returned, see `output_slots`)."""
        ops = self._trace.ops
        vals = [ops[label].out if slot is None else ops[label].outs[slot] for label, slot in self.output_slots]
        if len(vals) == 1:
            return vals[0]
        return tuple(vals)

    @property
    def num_layers(self) -> int:
        ops = self._trace.ops
        return len({ops[label].layer_label for label in self.op_labels})

    @property
    def module(self) -> "Module":
        return self._trace.modules[self.address]

    @property
    def facets(self) -> Any:
        """The named facets of this call (`torchlens.facets`): structural outputs and recipe facets."""
        return port("call_facets")(self)

    def __repr__(self) -> str:
        return f"<ModuleCall {self.label}: {len(self.op_labels)} ops>"

    def _repr_html_(self) -> str:
        call_html = port("call_html")

        return call_html(self)


class Module:
    """A captured module (address `"self"` is the root): its place in the tree and its calls."""

    __slots__ = (
        "address", "class_name", "class_qualname", "parent", "children", "_calls", "param_addresses",
        "buffer_addresses", "all_addresses", "training", "_trace", "_attribute_writes",
    )

    def __init__(self, address: str, class_name: str, class_qualname: str, parent: str | None,
                 all_addresses: tuple[str, ...], training: bool) -> None:
        self.address = address
        self.class_name = class_name
        self.class_qualname = class_qualname
        self.parent = parent
        self.children: list[str] = []
        self.calls = []
        self.param_addresses: list[str] = []
        self.buffer_addresses: list[str] = []
        self.all_addresses = all_addresses or (address,)
        self.training = training
        self._attribute_writes: dict[str, Any] | None = None

    @property
    def attribute_writes(self) -> Any:
        """{attribute name: AttributeWrite} the forward wrote on this module ({} when none);
        None when no record exists (a loaded trace, a backend that does not record them)."""
        from types import MappingProxyType

        return None if self._attribute_writes is None else MappingProxyType(self._attribute_writes)

    @property
    def custom_attributes(self) -> Any:
        """{name: value} of the live module's atomic attributes (numbers, strings, bools, small
        tuples of them) and its config's scalars (a Hugging Face `config`: `num_attention_heads`,
        ... plus `config.<name>` keys), snapshotted before the forward by the backend (facets
        spec: recipes read them through `tl.facets.config_value`). Empty when the backend
        recorded none."""
        from types import MappingProxyType

        ann = getattr(self._trace, "annotations", None) or {}
        return MappingProxyType((ann.get("module_custom_attributes") or {}).get(self.address) or {})

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def depth(self) -> int:
        return 0 if self.address == "self" else self.address.count(".") + 1

    @property
    def params(self) -> list["Param"]:
        """The Param records this module registers itself, once each, in registration order.
        A tied parameter counts at every module that registers it, through an alias too
        (GPT-2's `lm_head` holds `transformer.wte.weight`): what `module.parameters(recurse=False)`
        yields in torch."""
        return _distinct(rec for _, rec in self._param_paths(direct=True))

    def _param_paths(self, direct: bool) -> list[tuple[str, "Param"]]:
        """(path, record) for every address or alias of a parameter registered on this module
        (direct) or anywhere below it, under any of the module's own addresses, in the
        trace's parameter order."""
        names = self.all_addresses
        out = []
        for rec in self._trace._params.values():
            for path in rec.addresses:
                owner = path.rpartition(".")[0] or "self"
                if direct:
                    hit = owner in names
                else:
                    hit = "self" in names or any(owner == n or owner.startswith(n + ".") for n in names)
                if hit:
                    out.append((path, rec))
        return out

    @property
    def buffers(self) -> list["Buffer"]:
        return [self._trace.buffers[a] for a in self.buffer_addresses]

    @property
    def layer_labels(self) -> list[str]:
        seen: dict[str, None] = {}
        for call in self.calls:
            for label in call.op_labels:
                seen.setdefault(self._trace.ops[label].layer_label, None)
        return list(seen)

    @property
    def num_params(self) -> int:
        """Elements of the parameters this module registers itself (not its submodules'),
        a tied one counted once: `sum(p.numel() for p in module.parameters(recurse=False))`."""
        return sum(p.numel for p in self.params)

    @property
    def all_param_addresses(self) -> list[str]:
        """The paths of the parameters of this module and every submodule, one per parameter
        (its first path below this module, aliases included): what `module.named_parameters()`
        lists in torch, prefixed with the module's address."""
        seen: set[int] = set()
        out = []
        for path, rec in self._param_paths(direct=False):
            if id(rec) not in seen:
                seen.add(id(rec))
                out.append(path)
        return out

    @property
    def num_params_total(self) -> int:
        """Elements of `all_param_addresses`, a tied parameter once: a GPT-2 block's count,
        not its direct 0 (`sum(p.numel() for p in module.parameters())`)."""
        return sum(p.numel for p in _distinct(rec for _, rec in self._param_paths(direct=False)))

    @property
    def output_ops(self) -> list["Op"]:
        return [op for call in self.calls for op in call.output_ops]

    @property
    def out(self) -> Any:
        if len(self.calls) != 1:
            from torchlens.errors import AmbiguousOpLookupError

            raise AmbiguousOpLookupError(
                "ambiguous_op_lookup",
                f"module {self.address!r} was called {len(self.calls)} times",
                remedy="read one call: " + ", ".join(c.label for c in self.calls[:4]),
                candidates=[c.label for c in self.calls],
            )
        return self.calls[0].out

    @property
    def facets(self) -> Any:
        """The named facets of this module's single call (`torchlens.facets`); a module called
        more than once refuses (`facet_module_multi_call`): read `module.calls[n].facets`."""
        return port("module_facets")(self)

    @property
    def collapse_score(self) -> float:
        """How strongly drawing prefers to fold this module into one box (higher first)."""
        collapse_score = port("collapse_score")

        return collapse_score(self)

    @property
    def calls(self) -> list["ModuleCall"]:
        """This module's calls in order; also keyed: `module.calls[op_label]` is the call of
        this module that ran that op, `module.calls["address:N"]` call N."""
        return self._calls

    @calls.setter
    def calls(self, value: Any) -> None:
        self._calls = OwnedRecords(value, self)

    def _own_key(self, calls: list, key: str) -> "ModuleCall":
        from torchlens.errors import LookupMissError

        for c in calls:
            if c.label == key:
                return c
        op = self._trace._op_by_any_label(key)
        if op is not None:
            mine = [c for c in calls if op.label in c.op_labels]
            if mine:
                return mine[-1]
        raise LookupMissError("label_unknown", f"{key!r} names no op or call of module {self.address!r}",
                              remedy="use an op label this module ran, or one of "
                                     + ", ".join(c.label for c in calls[:6]), key=key)

    def __getitem__(self, key: str) -> Any:
        """`module[address]` is a descendant, `module["address:N"]` its call, a label what
        `trace[label]` gives (addresses are relative to this module)."""
        if self.address != "self":
            full = f"{self.address}.{key}"
            if full.split(":")[0] in self._trace.modules._records:
                return self._trace[full]
        return self._trace[key]

    def __repr__(self) -> str:
        return f"<Module {self.address} ({self.class_name}): {self.num_calls} call{'s' if self.num_calls != 1 else ''}>"

    def _repr_html_(self) -> str:
        module_html = port("module_html")

        return module_html(self)


class Param:
    """A registered parameter: address, shape, dtype, trainability and the ops that read it."""

    __slots__ = ("address", "module", "name", "shape", "dtype", "trainable", "value", "device",
                 "consumer_labels", "aliases", "_trace")

    def __init__(self, address: str, module: str, name: str, shape: tuple[int, ...], dtype: str,
                 trainable: bool, value: Any, device: str, aliases: tuple[str, ...] = ()) -> None:
        self.address = address
        self.module = module
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.trainable = trainable
        self.value = value
        self.device = device
        self.consumer_labels: list[str] = []
        self.aliases = tuple(aliases)  # other addresses of a tied parameter; `address` is the first path

    @property
    def label(self) -> str:
        return self.address

    @property
    def value_basis(self) -> str:
        """Where a value of this parameter comes from (experimental; computed when read, never
        saved; `value` keeps its live-handle meaning): `"snapshot"` when the trace carries a
        capture-time snapshot holding it (`CaptureOptions(snapshot_params=True)` or
        `replayable=True`, `torchlens.bundle.snapshot_params`, or a loaded runnable artifact's
        state), `"live_ref"` when the live-model handle resolves (the value may have moved since
        capture), and for a loaded trace `"persisted(save_time)"` (a `level="full"` save writes
        the values the parameters held when it was saved: an addition to the glossary's
        vocabulary, whose saves write no parameter bytes) or `"absent(not_persisted)"` (no
        bytes in the file)."""
        trace = getattr(self, "_trace", None)
        if trace is not None:
            snap = port("param_snapshot_of")(trace)
            if snap is not None and self.address in snap:
                return "snapshot"
            state = getattr(getattr(trace, "runnable", None), "_state", None) or {}
            if self.address in state:
                return "snapshot"
            if trace.__dict__.get("_params_from_artifact"):
                return "persisted(save_time)" if self.value is not None else "absent(not_persisted)"
        return "live_ref" if self.value is not None else "absent(not_persisted)"

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every module path this parameter is registered at (one unless tied)."""
        return (self.address, *self.aliases)

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def num_calls(self) -> int:
        return len(self.consumer_labels)

    @property
    def executed(self) -> bool:
        return bool(self.consumer_labels)

    @property
    def nbytes(self) -> int:
        from torchlens.records.op import itemsize

        return self.numel * itemsize(self.dtype)

    def __repr__(self) -> str:
        return f"<Param {self.address}: {tuple(self.shape)}, {self.dtype}{'' if self.trainable else ', frozen'}>"

    def _repr_html_(self) -> str:
        param_html = port("param_html")

        return param_html(self)


class Buffer:
    """A registered or module-held buffer; `op_labels` are its recorded version ops."""

    __slots__ = ("address", "module", "name", "shape", "dtype", "value", "persistent", "device",
                 "op_labels", "_trace")

    def __init__(self, address: str, module: str, name: str, shape: tuple[int, ...], dtype: str,
                 value: Any, persistent: bool, device: str) -> None:
        self.address = address
        self.module = module
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.value = value
        self.persistent = persistent
        self.device = device
        self.op_labels: list[str] = []

    @property
    def label(self) -> str:
        return self.address

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def versions(self) -> list["Op"]:
        return [self._trace.ops[label] for label in self.op_labels]

    def __repr__(self) -> str:
        return f"<Buffer {self.address}: {tuple(self.shape)}, {self.dtype}>"

    def _repr_html_(self) -> str:
        buffer_html = port("buffer_html")

        return buffer_html(self)
