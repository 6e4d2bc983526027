"""Accessors: ordered, label-addressed collections of records (`trace.ops`, `.layers`, ...).

Every accessor serves `len()`, iteration in trace order, `.labels`, `count_by(*keys)` and
typed lookup: a typed entry point always returns its own kind and converts a key that
names exactly one such object (spec: indexing coherence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, TypeVar

from torchlens.errors import AmbiguousOpLookupError, InvalidArgumentError, LookupMissError
from torchlens.records.ports import port

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace

R = TypeVar("R")


def split_pass_token(key: str) -> tuple[str, str | None]:
    """`"relu_1_2:3"` -> (`"relu_1_2"`, `"3"`); no suffix -> (key, None)."""
    if ":" in key:
        base, _, token = key.rpartition(":")
        return base, token
    return key, None


def label_alias(key: str) -> str | None:
    """The label an older spelling stands for, or None: layer labels' type token is the
    callable's name lower-cased without underscores (PyPI torchlens's `batchnorm_1_5`), and
    the underscored spelling (`batch_norm_1_5`, `scaled_dot_product_attention_1_3:2`) is
    accepted on lookup as an alias of it. None when `key` has no `{type}_{n}_{m}` form or is
    already in canonical form."""
    base, token = split_pass_token(key)
    head, sep, step = base.rpartition("_")
    type_, sep2, num = head.rpartition("_")
    if not (sep and sep2 and type_ and num.isdigit() and step.isdigit()):
        return None
    canon = type_.lower().replace("_", "")
    if canon == type_ or not canon:
        return None
    alias = f"{canon}_{num}_{step}"
    return alias if token is None else f"{alias}:{token}"


def canonical_label(trace: "Trace", key: str) -> str:
    """`key`, or the label its older underscored spelling stands for when `key` names no op,
    layer or module of `trace` and the alias names a layer or op (see `label_alias`)."""
    if (key in trace._ops or key in trace._layers or key in trace._modules or key in trace._params
            or key in trace._buffers or "_" not in key):
        return key
    alias = label_alias(key)
    if alias is None:
        return key
    base = split_pass_token(alias)[0]
    return alias if alias in trace._ops or base in trace._layers else key


class Collection(Generic[R]):
    """Ordered mapping of label -> record with the shared accessor behaviour."""

    kind = "record"
    _count_fields: tuple[str, ...] = ()

    def __init__(self, trace: "Trace", records: dict[str, R]) -> None:
        self._trace = trace
        self._records = records

    # container protocol ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[R]:
        return iter(self._records.values())

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __bool__(self) -> bool:
        return bool(self._records)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self._records)

    def keys(self):
        return self._records.keys()

    def values(self):
        return self._records.values()

    def items(self):
        return self._records.items()

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def _filtered(self, pred: Callable[[R], bool]) -> "Collection[R]":
        return type(self)(self._trace, {k: v for k, v in self._records.items() if pred(v)})

    def filter(self, pred: Callable[[R], bool]) -> "Collection[R]":
        """The members for which `pred(record)` is true, as a collection of the same kind."""
        return self._filtered(pred)

    def __getitem__(self, key: Any) -> R:
        if isinstance(key, int) and not isinstance(key, bool):
            try:
                return list(self._records.values())[key]
            except IndexError:
                raise LookupMissError("label_unknown", f"index {key} is out of range for {len(self)} {self.kind}s",
                                      remedy=f"use an index in range({len(self)})", key=key) from None
        if not isinstance(key, str):
            raise InvalidArgumentError("invalid_argument", f"{self.kind} lookup takes a label or an index, not {type(key).__name__}",
                                       remedy="pass a label string such as one from .labels", key=repr(key))
        rec = self._records.get(key)
        if rec is not None:
            return rec
        alias = canonical_label(self._trace, key)  # `batch_norm_1_5` names `batchnorm_1_5`
        if alias != key:
            return self[alias]
        return self._convert(key)

    def _convert(self, key: str) -> R:
        raise self._miss(key)

    def _miss(self, key: str) -> LookupMissError:
        import difflib

        pool = list(self._records)
        if self.kind == "op":  # suggest layer labels and module addresses too
            pool += list(self._trace._layers) + list(self._trace._modules)
        close = difflib.get_close_matches(key, list(dict.fromkeys(pool)), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        if self.kind in ("module", "module call") and split_pass_token(key)[0] in self._trace.uncalled_modules:
            return LookupMissError("label_unknown", f"module {key!r} exists but was never called: an uncalled module has "
                                   "no record", remedy="list uncalled module addresses with trace.modules.uncalled",
                                   key=key, uncalled=True, suggestions=[])
        return LookupMissError("label_unknown", f"no {self.kind} {key!r} in this trace{hint}",
                               remedy=f"list the valid keys with .labels ({len(self)} {self.kind}s)", key=key,
                               suggestions=close)

    # counting --------------------------------------------------------------------------
    def count_by(self, *keys: str) -> dict[Any, int]:
        """Count records by one or more fields: `{value: n}` or `{(v1, v2): n}`."""
        if not keys:
            raise InvalidArgumentError("accessor_count_by_key_required", "count_by() needs at least one field name",
                                       remedy=f"for example count_by({self._example_field()!r})")
        recs = list(self._records.values())
        for k in keys:
            if recs and not self._has_field(recs[0], k):
                raise InvalidArgumentError("accessor_count_by_key_unknown", f"{self.kind} records have no field {k!r}",
                                           remedy=f"countable fields include: {', '.join(self._countable())}", key=k)
        out: dict[Any, int] = {}
        for r in recs:
            vals = tuple(self._field(r, k) for k in keys)
            v = vals[0] if len(keys) == 1 else vals
            out[v] = out.get(v, 0) + 1
        return out

    def _field(self, rec: Any, key: str) -> Any:
        if key == "kind" and hasattr(rec, "func_name"):  # the op family token: __add__ and add_ are "add"
            normalize_type = port("normalize_type")

            return normalize_type(rec.func_name)
        return getattr(rec, key)

    def _has_field(self, rec: Any, key: str) -> bool:
        if key == "kind" and hasattr(rec, "func_name"):
            return True
        try:
            v = getattr(rec, key)
        except AttributeError:
            return False
        except Exception:  # a payload read that refuses is not countable
            return False
        return isinstance(v, (str, int, float, bool, tuple, type(None)))

    def _countable(self) -> list[str]:
        recs = list(self._records.values())
        if not recs:
            return []
        names = [n for n in dir(recs[0]) if not n.startswith("_")]
        return [n for n in names if self._has_field(recs[0], n)]

    def _example_field(self) -> str:
        return "module" if self.kind in ("op", "layer") else (self._countable() or ["address"])[0]

    def to_pandas(self) -> Any:
        """One row per record, as a pandas DataFrame (needs pandas)."""
        collection_dataframe = port("collection_dataframe")

        return collection_dataframe(self)

    def __repr__(self) -> str:
        labels = list(self._records)
        head = ", ".join(labels[:6]) + (", ..." if len(labels) > 6 else "")
        return f"<{len(self)} {self.kind}s: {head}>"

    def _repr_html_(self) -> str:
        collection_html = port("collection_html")

        return collection_html(self)


class OpCollection(Collection):
    kind = "op"

    @property
    def compute(self) -> "OpCollection":
        return self._filtered(lambda o: o.kind == "op")

    @property
    def saved(self) -> "OpCollection":
        return self._filtered(lambda o: o.saved)

    @property
    def nonfinite(self) -> "OpCollection":
        """Ops whose output held NaN or Inf (verdicts recorded under on_nonfinite='track',
        'warn' or 'raise'; the backend writes `meta["has_nonfinite"]`)."""
        return self._filtered(lambda o: bool(o.meta.get("has_nonfinite", False)))

    def _convert(self, key: str):
        trace = self._trace
        base, token = split_pass_token(key)
        layer = trace._layers.get(base)
        if layer is not None:
            if token is None:
                if len(layer.ops) == 1:
                    return self._own(layer.ops[0], key)
                raise AmbiguousOpLookupError(
                    "ambiguous_op_lookup", f"{key!r} is a layer with {len(layer.ops)} passes; an Op lookup needs one",
                    remedy=f"name one pass: {base}:1 .. {base}:{len(layer.ops)}, or {base}:last",
                    key=key, candidates=[o.label for o in layer.ops])
            if token == "all":
                raise AmbiguousOpLookupError(
                    "ambiguous_op_lookup", f"{key!r} names every pass; an Op collection returns one Op",
                    remedy=f"use trace[{key!r}] or trace[tl.label({key!r})] for the Selection of all passes",
                    key=key, candidates=[o.label for o in layer.ops])
            return self._own(trace._pass_op(layer, token, key), key)
        # module address (or address:N): the call's output op
        mod_base = base if token is not None and token.isdigit() else key
        mod = trace._modules.get(mod_base)
        if mod is not None:
            calls = mod.calls
            if token is not None and token.isdigit() and mod_base == base:
                calls = [c for c in calls if c.call == int(token)]
                if not calls:
                    raise LookupMissError("pass_out_of_range", f"module {base!r} has no call {token}",
                                          remedy=f"calls are 1..{mod.num_calls}", key=key)
            outs = [o for c in calls for o in c.output_labels]
            if len(outs) == 1:
                return self._own(trace._ops[outs[0]], key)
            if not outs:
                raise LookupMissError("label_unknown", f"module {mod_base!r} has no output op", key=key,
                                      remedy="the module was not called or returned no tensor")
            spell = [c.label for c in calls] if len(calls) > 1 else outs
            raise AmbiguousOpLookupError("ambiguous_op_lookup", f"{key!r} names {len(outs)} output ops",
                                         remedy="name one: " + ", ".join(spell[:6]), key=key, candidates=spell)
        raise self._miss(key)

    def _own(self, op, key):
        if op.label in self._records:
            return op
        raise self._miss(key)


class LayerCollection(Collection):
    kind = "layer"

    @property
    def compute(self) -> "LayerCollection":
        return self._filtered(lambda l: l.kind == "op")

    @property
    def recurrent(self) -> "LayerCollection":
        return self._filtered(lambda l: len(l.ops) > 1)

    @property
    def saved_grad(self) -> "LayerCollection":
        """Layers with a saved gradient on at least one pass."""
        return self._filtered(lambda l: any(o.grads is not None and any(g is not None for g in o.grads) for o in l.ops))

    @property
    def internal_source(self) -> "LayerCollection":
        """Layers whose values the forward made from nothing it was given: constants and
        compute ops with no op parents (`torch.zeros`, `arange`, a random draw)."""
        return self._filtered(lambda l: all(o.kind == "constant" or (o.kind == "op" and not o.parents) for o in l.ops))

    @property
    def internal_sink(self) -> "LayerCollection":
        """Compute layers whose values nothing read: no child op and not the model's output."""
        return self._filtered(lambda l: l.kind == "op" and all(not o.children for o in l.ops))

    def _convert(self, key: str):
        base, token = split_pass_token(key)
        if base in self._records and token is not None:
            return self._records[base]
        op = self._trace.ops[key]  # module address -> its output op's layer; raises typed errors
        return self[op.layer_label]


class ModuleCollection(Collection):
    kind = "module"

    @property
    def uncalled(self) -> tuple[str, ...]:
        return tuple(self._trace.uncalled_modules)

    def _convert(self, key: str):
        trace = self._trace
        base, token = split_pass_token(key)
        if base in self._records and token is not None and token.isdigit():
            return self._records[base]
        for m in self._records.values():  # an alias spelling
            if key in m.all_addresses:
                return m
        if key in trace._params:
            return self._records[trace._params[key].module]
        if key in trace._buffers:
            return self._records[trace._buffers[key].module]
        op = trace._op_by_any_label(key)
        if op is not None:
            return self._records[op.module or "self"]
        raise self._miss(key)


class ModuleCallCollection(Collection):
    kind = "module call"

    def _convert(self, key: str):
        trace = self._trace
        if key in trace._modules:
            calls = trace._modules[key].calls
            if len(calls) == 1:
                return calls[0]
            raise AmbiguousOpLookupError("ambiguous_op_lookup", f"module {key!r} was called {len(calls)} times",
                                         remedy="name one call: " + ", ".join(c.label for c in calls[:6]),
                                         key=key, candidates=[c.label for c in calls])
        op = trace._op_by_any_label(key)
        if op is not None and op.module_calls:
            return self._records[op.module_calls[-1]]
        raise self._miss(key)


class _StateCollection(Collection):
    def _convert(self, key: str):
        trace = self._trace
        if key in trace._modules:
            mine = [r for r in self._records.values() if r.module == key]
            if len(mine) == 1:
                return mine[0]
            if mine:
                raise AmbiguousOpLookupError("ambiguous_op_lookup", f"module {key!r} owns {len(mine)} {self.kind}s",
                                             remedy="name one: " + ", ".join(r.address for r in mine[:6]),
                                             key=key, candidates=[r.address for r in mine])
            raise self._miss(key)
        op = trace._op_by_any_label(key)
        if op is not None:
            addrs = self._op_addresses(op)
            if len(addrs) == 1:
                return self._records[addrs[0]]
            if addrs:
                raise AmbiguousOpLookupError("ambiguous_op_lookup", f"op {key!r} reads {len(addrs)} {self.kind}s",
                                             remedy="name one: " + ", ".join(addrs[:6]), key=key, candidates=list(addrs))
        raise self._miss(key)

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self._records.values())


class ParamCollection(_StateCollection):
    """Parameter records, one per stored value: a tied parameter (GPT-2's `wte`/`lm_head`
    weight) is one Param whose `aliases` hold its other module paths, so `.numel` counts it
    once and `.numel_by_path` once per path (spec glossary: Trace.params filters and totals);
    an alias address looks up the same record."""

    kind = "param"

    def _op_addresses(self, op):
        return [a for a in op.params if a in self._records]

    def _convert(self, key: str):
        for p in self._records.values():
            if key in p.aliases:
                return p
        return super()._convert(key)

    @property
    def numel_by_path(self) -> int:
        """Elements counted once per module path a parameter is registered at."""
        return sum(r.numel * (1 + len(r.aliases)) for r in self._records.values())

    @property
    def trainable(self) -> "ParamCollection":
        return self._filtered(lambda p: p.trainable)

    @property
    def frozen(self) -> "ParamCollection":
        return self._filtered(lambda p: not p.trainable)

    @property
    def executed(self) -> "ParamCollection":
        return self._filtered(lambda p: p.executed)

    @property
    def unexecuted(self) -> "ParamCollection":
        return self._filtered(lambda p: not p.executed)


class BufferCollection(_StateCollection):
    kind = "buffer"

    def _op_addresses(self, op):
        if op.kind == "buffer" and op.path in self._records:
            return [op.path]
        return []


class OwnedRecords(list):
    """The list a record owns (`Layer.ops`, `Module.calls`): a plain list by position, and by
    string key the typed-entry-point rule (spec: indexing coherence) restricted to its own
    members: `layer.ops["address:N"]` is that call's output op if this layer ran it,
    `module.calls[op_label]` the call of this module that ran the op."""

    __slots__ = ("_owner",)

    def __init__(self, items: Any = (), owner: Any = None) -> None:
        super().__init__(items)
        self._owner = owner

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._owner._own_key(self, key)
        return super().__getitem__(key)
