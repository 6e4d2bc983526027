"""Site selectors and their composition (`&`, `|`, `-`, `~`).

Each primitive selector computes the set of op labels it matches in a trace; compositions
combine those sets; resolution returns them in trace order as a `Selection`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torchlens.errors import (
    AmbiguousOpLookupError,
    LookupMissError,
    SelectorCompositionError,
)
from torchlens.records.collections import canonical_label, split_pass_token
from torchlens.select.selection import Selection

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace


class Selector:
    """Base of every site selector. Compose with `&` (both), `|` (either), `-` (minus) and
    `~` (not); resolve with `trace[selector]` or `trace.find_sites(selector)`."""

    kind: str = "selector"

    @property
    def universe(self) -> str:
        """Which sites this selector names: "activation" (forward outputs), "gradient"
        (`tl.grad(...)`: the output gradients of forward ops) or "mixed" (a union of both)."""
        return "activation"

    def match_set(self, trace: "Trace") -> set[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def resolve(self, trace: "Trace") -> Selection:
        labels = self.match_set(trace)
        ops = [o for o in trace._ops.values() if o.label in labels]
        return Selection(trace, ops, self)

    def _other(self, other: Any, op: str) -> "Selector":
        if getattr(other, "_tl_subspace", False):  # a tl.subspace edits a component, not a set of sites
            other._composed()
        if not isinstance(other, Selector):
            raise SelectorCompositionError("selector_operand_invalid",
                                           f"cannot compose {self!r} {op} {type(other).__name__}",
                                           remedy="wrap labels in tl.label(...) before composing", operand=repr(other))
        return other

    def __and__(self, other: Any) -> "Selector":
        other = self._other(other, "&")
        if getattr(other, "_tl_facet", False):  # tl.module(a) & tl.head(i): the head scoped to module a
            return other & self
        _same_universe(self, other, "&")
        return _And(self, other)

    def __or__(self, other: Any) -> "Selector":
        other = self._other(other, "|")
        if getattr(other, "_tl_facet", False):  # a facet selector unites only with facet selectors: refuses
            return other.__ror__(self)
        if isinstance(self, GradSelector) and isinstance(other, GradSelector):
            return GradSelector(self.inner() | other.inner())  # one gradient branch
        return _Or(self, other)

    def __sub__(self, other: Any) -> "Selector":
        other = self._other(other, "-")
        _same_universe(self, other, "-")
        return _Sub(self, other)

    def __invert__(self) -> "Selector":
        if self.universe == "mixed":
            raise SelectorCompositionError(
                "selector_cross_universe_not", f"~ over {self!r}, a union spanning activation and gradient sites",
                remedy="negate inside each branch: tl.grad(~a) | ~a", selector=repr(self))
        return _Not(self)

    def __rand__(self, other: Any) -> "Selector":
        return self._other(other, "&") & self

    def __ror__(self, other: Any) -> "Selector":
        return self._other(other, "|") | self


def _same_universe(a: Selector, b: Selector, op: str) -> None:
    """`&` and `-` keep sites both sides name, which only means something inside one universe."""
    ua, ub = a.universe, b.universe
    if ua != ub or ua == "mixed":
        raise SelectorCompositionError(
            "selector_cross_universe_and", f"{a!r} {op} {b!r} combines {ua} and {ub} sites",
            remedy="intersect inside one universe: tl.grad(a & b), or a & b for activations",
            left=repr(a), right=repr(b))


@dataclass(frozen=True, repr=False)
class _And(Selector):
    a: Selector
    b: Selector
    kind = "and"

    @property
    def universe(self) -> str:
        return self.a.universe

    def match_set(self, trace):
        return self.a.match_set(trace) & self.b.match_set(trace)

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


@dataclass(frozen=True, repr=False)
class _Or(Selector):
    a: Selector
    b: Selector
    kind = "or"

    @property
    def universe(self) -> str:
        ua, ub = self.a.universe, self.b.universe
        return ua if ua == ub else "mixed"

    def match_set(self, trace):
        return self.a.match_set(trace) | self.b.match_set(trace)

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


@dataclass(frozen=True, repr=False)
class _Sub(Selector):
    a: Selector
    b: Selector
    kind = "sub"

    @property
    def universe(self) -> str:
        return self.a.universe

    def match_set(self, trace):
        return self.a.match_set(trace) - self.b.match_set(trace)

    def __repr__(self):
        return f"({self.a!r} - {self.b!r})"


@dataclass(frozen=True, repr=False)
class _Not(Selector):
    a: Selector
    kind = "not"

    @property
    def universe(self) -> str:
        return self.a.universe

    def match_set(self, trace):
        return set(trace._ops) - self.a.match_set(trace)

    def __repr__(self):
        return f"~{self.a!r}"


def _func_name(fn: Any) -> str:
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", None)
    if name is None:
        raise SelectorCompositionError("selector_operand_invalid", f"tl.func takes a name or a callable, not {type(fn).__name__}",
                                       remedy="tl.func('relu') or tl.func(torch.relu)", operand=repr(fn))
    return name


@dataclass(frozen=True, repr=False)
class FuncSelector(Selector):
    """Ops whose callable is `name` (`"relu"` also matches `relu_`, `__add__` matches `add`)."""

    name: str
    kind = "func"

    def match_set(self, trace):
        from torchlens.build.builder import normalize_type

        want = self.name
        want_norm = normalize_type(want)
        return {o.label for o in trace._ops.values()
                if o.kind == "op" or o.kind == "constant"
                if o.func_name == want or normalize_type(o.func_name) == want_norm}

    def __repr__(self):
        return f"tl.func({self.name!r})"


def _module_and_call(trace: "Trace", address: str) -> tuple[str, int | None]:
    base, token = split_pass_token(address)
    if address in trace.uncalled_modules:  # no record, no ops: the selector matches nothing (zero fire)
        return address, None
    if token is not None and token.isdigit() and base in trace.uncalled_modules:
        return base, int(token)
    if token is not None and token.isdigit() and base in trace._modules:
        return base, int(token)
    if address in trace._modules:
        return address, None
    for m in trace._modules.values():
        if base in m.all_addresses and base != m.address:  # an alias spelling: no hook can tell the names apart
            raise SelectorCompositionError(
                "bind_static_anchor_unresolved", f"{address!r} is an alias of module {m.address!r}; a forward cannot "
                "tell which name it called the module through", remedy=f"select the canonical name tl.module({m.address!r}) "
                "(it fires at every call site of the module)", address=address, canonical=m.address,
                aliases=list(m.all_addresses))
    import difflib

    close = difflib.get_close_matches(address, list(trace._modules), n=3)
    raise LookupMissError("label_unknown", f"no module {address!r} in this trace" + (f"; did you mean {', '.join(close)}?" if close else ""),
                          remedy="list module addresses with trace.modules.labels", key=address, suggestions=close)


@dataclass(frozen=True, repr=False)
class ModuleSelector(Selector):
    """The output op(s) of a module's calls (`"addr:N"` for one call)."""

    address: str
    kind = "module"

    def match_set(self, trace):
        base, call = _module_and_call(trace, self.address)
        mod = trace._modules.get(base)
        if mod is None:  # an uncalled module
            return set()
        calls = mod.calls if call is None else [c for c in mod.calls if c.call == call]
        return {label for c in calls for label in c.output_labels}

    def __repr__(self):
        return f"tl.module({self.address!r})"


@dataclass(frozen=True, repr=False)
class InModuleSelector(Selector):
    """Every op that ran inside a module (at any depth), or inside one call `"addr:N"`."""

    address: str
    kind = "in_module"

    def match_set(self, trace):
        base, call = _module_and_call(trace, self.address)
        if call is None:
            return {o.label for o in trace._ops.values() if base in o.modules}
        cl = f"{base}:{call}"
        return {o.label for o in trace._ops.values() if cl in o.module_calls}

    def __repr__(self):
        return f"tl.in_module({self.address!r})"


@dataclass(frozen=True, repr=False)
class LabelSelector(Selector):
    """Exactly the op (or, with `:all`, the ops) a final label names."""

    label: str
    kind = "label"

    def match_set(self, trace):
        key = canonical_label(trace, self.label)  # `batch_norm_1_5` names `batchnorm_1_5`
        if key in trace._ops:
            return {key}
        base, token = split_pass_token(key)
        layer = trace._layers.get(base)
        if layer is None:
            trace.ops[key]  # raises the typed miss with suggestions
            return set()  # pragma: no cover
        if token is None:
            raise AmbiguousOpLookupError(
                "multipass_bare_label_ambiguous",
                f"{key!r} is a layer with {len(layer.ops)} passes; tl.label needs one op",
                remedy=f"write {base}:1 .. {base}:{len(layer.ops)}, {base}:last, or {base}:all for every pass",
                key=key, candidates=[o.label for o in layer.ops])
        if token == "all":
            return {o.label for o in layer.ops}
        return {trace._pass_op(layer, token, key).label}

    def __repr__(self):
        return f"tl.label({self.label!r})"


@dataclass(frozen=True, repr=False)
class LabelContainsSelector(Selector):
    text: str
    kind = "label_contains"

    def match_set(self, trace):
        return {label for label in trace._ops if self.text in label}

    def __repr__(self):
        return f"tl.label_contains({self.text!r})"


@dataclass(frozen=True, repr=False)
class LabelMatchesSelector(Selector):
    pattern: str
    kind = "label_matches"

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise SelectorCompositionError("selector_pattern_invalid", f"{self.pattern!r} is not a valid regex: {exc}",
                                           remedy="escape special characters with re.escape", pattern=self.pattern) from exc

    def match_set(self, trace):
        rx = re.compile(self.pattern)
        return {label for label in trace._ops if rx.search(label)}

    def __repr__(self):
        if self.kind == "all_sites":
            return "tl.all_sites()"
        return f"tl.label_matches({self.pattern!r})"


@dataclass(frozen=True, repr=False)
class AllSitesSelector(LabelMatchesSelector):
    kind = "all_sites"


_WHERE_FIELDS = ("label", "layer_label", "func_name", "kind", "module", "pass_number", "num_passes", "shape",
                 "dtype", "path", "is_inplace", "saved", "index")


@dataclass(frozen=True, repr=False)
class WhereSelector(Selector):
    """Ops for which `predicate(op)` is true and whose fields equal the given values."""

    predicate: Callable[[Any], bool] | None
    fields: tuple[tuple[str, Any], ...] = ()
    kind = "where"

    def match_set(self, trace):
        out = set()
        for o in trace._ops.values():
            if any(getattr(o, k) != v for k, v in self.fields):
                continue
            if self.predicate is not None and not self.predicate(o):
                continue
            out.add(o.label)
        return out

    def __repr__(self):
        parts = [getattr(self.predicate, "__name__", "predicate")] if self.predicate else []
        parts += [f"{k}={v!r}" for k, v in self.fields]
        return f"tl.where({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class PlaceholderSelector(Selector):
    """A loaded rule's target that was user code (a `tl.where` predicate): only its text was
    saved, so it cannot match anything. Resolving it raises `run_intervention_spec_not_persisted`."""

    text: str
    rule: int | None = None
    kind = "placeholder"

    def match_set(self, trace):
        from torchlens.io.intervention import not_persisted

        raise not_persisted(self.rule, self.text)

    def __repr__(self):
        return f"<placeholder {self.text}>"


@dataclass(frozen=True, repr=False)
class ModelInputSelector(Selector):
    path: str | None = None
    kind = "model_input"

    def match_set(self, trace):
        return {o.label for o in trace._ops.values() if o.kind == "input" and (self.path is None or o.path == self.path)}

    def __repr__(self):
        return "tl.model_input()" if self.path is None else f"tl.model_input({self.path!r})"


@dataclass(frozen=True, repr=False)
class ModelOutputSelector(Selector):
    path: str | None = None
    kind = "model_output"

    def match_set(self, trace):
        return {o.label for o in trace._ops.values() if o.kind == "output" and (self.path is None or o.path == self.path)}

    def __repr__(self):
        return "tl.model_output()" if self.path is None else f"tl.model_output({self.path!r})"


# public constructors --------------------------------------------------------------------

def func(name: Any) -> Selector:
    """Ops whose callable is `name` (a string or the callable itself)."""
    return FuncSelector(_func_name(name))


def module(address: str) -> Selector:
    """The output op of each call of module `address` (`"address:N"`: call N only)."""
    return ModuleSelector(_str_arg(address, "module"))


def in_module(address: str) -> Selector:
    """Every op inside module `address` (at any depth); `"address:N"` for one call."""
    return InModuleSelector(_str_arg(address, "in_module"))


def label(text: str) -> Selector:
    """The op a final label names; pass tokens `label:N`, `label:last`, `label:all`."""
    return LabelSelector(_str_arg(text, "label"))


def label_contains(text: str) -> Selector:
    return LabelContainsSelector(_str_arg(text, "label_contains"))


def label_matches(pattern: str) -> Selector:
    return LabelMatchesSelector(_str_arg(pattern, "label_matches"))


def all_sites() -> Selector:
    """Every op of the trace (the same match as `label_matches('.*')`)."""
    return AllSitesSelector(".*")


def where(predicate: Callable[[Any], bool] | None = None, **fields: Any) -> Selector:
    """Ops with `predicate(op)` true and `op.<field> == value` for each keyword."""
    unknown = [k for k in fields if k not in _WHERE_FIELDS]
    if unknown:
        raise SelectorCompositionError("selector_key_unknown", f"tl.where got unknown field(s) {', '.join(unknown)}",
                                       remedy=f"fields: {', '.join(_WHERE_FIELDS)}", keys=unknown)
    if predicate is not None and not callable(predicate):
        raise SelectorCompositionError("selector_operand_invalid", "tl.where's predicate must be callable",
                                       remedy="tl.where(lambda op: op.numel > 10)")
    return WhereSelector(predicate, tuple(sorted(fields.items())))


def model_input(path: str | None = None) -> Selector:
    return ModelInputSelector(path)


def model_output(path: str | None = None) -> Selector:
    return ModelOutputSelector(path)


def _str_arg(value: Any, who: str) -> str:
    if not isinstance(value, str):
        raise SelectorCompositionError("selector_operand_invalid", f"tl.{who} takes a string, not {type(value).__name__}",
                                       remedy=f"tl.{who}('...')", operand=repr(value))
    return value


def as_selector(obj: Any) -> Selector:
    """A selector as-is; a string label as `tl.label`."""
    if isinstance(obj, Selector):
        return obj
    if isinstance(obj, str):
        return LabelSelector(obj)
    raise SelectorCompositionError("selector_operand_invalid", f"expected a selector or a label, got {type(obj).__name__}",
                                   remedy="use tl.func, tl.module, tl.label, ...", operand=repr(obj))


__all__ = ["Selector", "Selection", "func", "module", "in_module", "label", "label_contains", "label_matches",
           "all_sites", "where", "model_input", "model_output", "as_selector"]


# gradient sites ---------------------------------------------------------------------------

@dataclass(frozen=True, repr=False)
class GradSelector(Selector):
    """The gradient at the ops its inner selector (or label) matches: `tl.grad('relu_3')`.

    It resolves to the same ops as its inner selector; verbs that read gradients (saving,
    `trace.backward`) read `op.grad` at them.
    """

    site: Any
    kind = "grad"

    @property
    def universe(self) -> str:
        return "gradient"

    def inner(self) -> Selector:
        return as_selector(self.site)

    def __invert__(self) -> "Selector":
        return GradSelector(~self.inner())  # ~tl.grad(s) is tl.grad(~s)

    def match_set(self, trace):
        return self.inner().match_set(trace)

    def __repr__(self):
        return f"tl.grad({self.site!r})"


def _holds_facet(sel: Any) -> bool:
    """A facet or head selector (`tl.facet`, `tl.head`) anywhere in a composed selector."""
    if getattr(sel, "_tl_facet", False):
        return True
    return any(_holds_facet(getattr(sel, part)) for part in ("a", "b") if isinstance(getattr(sel, part, None), Selector))


def grad(site: Any) -> Selector:
    """The gradient at `site` (a selector or a label); refuses nesting and containers."""
    if isinstance(site, GradSelector):
        raise SelectorCompositionError("grad_selector_nested", f"tl.grad cannot wrap another gradient selector ({site!r})",
                                       remedy="use the inner selector once: tl.grad(site)", operand=repr(site))
    from torchlens.select.selection import Selection

    if isinstance(site, Selection):
        raise SelectorCompositionError("grad_selection_unsupported",
                                       "tl.grad takes a selector, not a resolved Selection",
                                       remedy="pass the selector itself: tl.grad(sel), not tl.grad(trace[sel])",
                                       operand=repr(site))
    from torchlens.records.op import Layer, Op

    if isinstance(site, Op):
        return GradSelector(site.label)  # a record names its own label
    if isinstance(site, Layer):
        return GradSelector(f"{site.label}:all")  # every pass of the layer
    if isinstance(site, Selector) and _holds_facet(site):
        raise SelectorCompositionError("grad_facet_unsupported", f"tl.grad({site!r}): a facet or head selector names a "
                                       "slice of a module output, which has no gradient site of its own",
                                       remedy="wrap the facet's home op instead: tl.grad(tl.module(address)) (the "
                                       "gradient of the whole output), and read the slice from trace[...].grad",
                                       operand=repr(site))
    if not isinstance(site, (str, Selector)):
        raise SelectorCompositionError("grad_selector_inner_invalid",
                                       f"tl.grad takes one selector or label, not {type(site).__name__}",
                                       remedy="combine sites with | first: tl.grad(tl.label('a') | tl.label('b'))",
                                       operand=repr(site))
    return GradSelector(site)


__all__ += ["GradSelector", "grad"]
