"""FacetSpec: where a facet's value lives (its home) and the transform chain that reads it.

A recipe never computes a facet; it returns a `FacetSpec` naming a home (an op's output
slot, a parameter, or a computed callable) plus a chain of structural primitives
(`[key]`, `heads`, `split`, `reshape`, `transpose`, `select`). Reading applies the chain
to the home value lazily. Each primitive carries a capability class; the chain's class is
the weakest of them (spec: Capability Classes), and only `bijective_view` / `selection`
chains can be written back (`scatter_update`).

Array work is duck-typed on the methods every backend array shares (`x[key]`,
`x.reshape(shape)`, `x.swapaxes(a, b)`), so this module imports no framework. Writing a
slice back uses the backend's `EditOps.clone` and item assignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from torchlens.errors import FacetError

#: capability classes, strongest first; a chain's class is the weakest of its primitives
CAPABILITIES: tuple[str, ...] = ("bijective_view", "selection", "aliasing_selection", "computed")
WRITABLE: frozenset[str] = frozenset({"bijective_view", "selection"})
HOME_KINDS: tuple[str, ...] = ("op", "module_output", "module_input", "parameter", "computed")


def weakest(classes: Any) -> str:
    """The intersection of capability classes: the weakest one in `CAPABILITIES` order."""
    rank = 0
    for c in classes:
        rank = max(rank, CAPABILITIES.index(c))
    return CAPABILITIES[rank]


def _norm_dim(dim: int, ndim: int) -> int:
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise FacetError("facet_transform_invalid", f"dimension {dim} is out of range for a {ndim}-d value",
                         remedy="pass a dimension inside the home value's rank", dim=dim, ndim=ndim)
    return d


def _clone(x: Any, ops: Any) -> Any:
    if ops is not None:
        return ops.clone(x)
    if hasattr(x, "clone"):
        return x.clone()
    return x.copy()


# primitives ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Primitive:
    """One step of a transform chain: `apply` reads, `scatter` writes an edited result back
    into the value it was read from (only for writable capability classes)."""

    capability: str = "bijective_view"

    def apply(self, x: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Index(Primitive):
    """`spec[key]`: an integer, slice or tuple of them (basic indexing only)."""

    key: Any = None
    capability: str = "selection"

    def apply(self, x: Any) -> Any:
        return x[self.key]

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        new = _clone(parent, ops)
        new[self.key] = edited
        return new

    def describe(self) -> str:
        return f"[{self.key!r}]"


@dataclass(frozen=True)
class Select(Primitive):
    """`spec.select(dim, index)`: one index along `dim` (the dimension is dropped)."""

    dim: int = 0
    index: int = 0
    capability: str = "selection"

    def _key(self, ndim: int) -> tuple:
        d = _norm_dim(self.dim, ndim)
        return (slice(None),) * d + (self.index,)

    def apply(self, x: Any) -> Any:
        shape = tuple(x.shape)
        d = _norm_dim(self.dim, len(shape))
        if not -shape[d] <= self.index < shape[d]:
            raise FacetError("facet_index_out_of_range", f"index {self.index} is out of range for dimension {self.dim} "
                             f"of size {shape[d]}", remedy=f"use an index in 0..{shape[d] - 1}", index=self.index,
                             size=shape[d])
        return x[self._key(len(shape))]

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        new = _clone(parent, ops)
        new[self._key(len(tuple(parent.shape)))] = edited
        return new

    def describe(self) -> str:
        return f".select({self.dim}, {self.index})"


@dataclass(frozen=True)
class Split(Primitive):
    """`spec.split(n_sections, dim)` followed by `[i]`: section `i` of `dim` cut into
    `n_sections` equal parts, or into the given `sizes` (a fused projection of unequal
    parts, such as GQA's q|k|v)."""

    n_sections: int = 1
    dim: int = -1
    section: int = 0
    sizes: tuple[int, ...] | None = None
    capability: str = "selection"

    def _bounds(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        d = _norm_dim(self.dim, len(shape))
        if self.sizes is not None:
            if sum(self.sizes) != shape[d]:
                raise FacetError("facet_transform_invalid", f"split sizes {self.sizes} do not add up to dimension {d} "
                                 f"of size {shape[d]}", remedy="pass sizes that cover the dimension", sizes=self.sizes)
            start = sum(self.sizes[:self.section])
            return d, start, start + self.sizes[self.section]
        if shape[d] % self.n_sections:
            raise FacetError("facet_transform_invalid", f"dimension {d} of size {shape[d]} does not split into "
                             f"{self.n_sections} equal sections", remedy="pass sizes= for unequal sections",
                             size=shape[d], n_sections=self.n_sections)
        step = shape[d] // self.n_sections
        return d, step * self.section, step * (self.section + 1)

    def _key(self, shape: tuple[int, ...]) -> tuple:
        d, a, b = self._bounds(shape)
        return (slice(None),) * d + (slice(a, b),)

    def apply(self, x: Any) -> Any:
        return x[self._key(tuple(x.shape))]

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        new = _clone(parent, ops)
        new[self._key(tuple(parent.shape))] = edited
        return new

    def describe(self) -> str:
        parts = f"sizes={list(self.sizes)}" if self.sizes else str(self.n_sections)
        return f".split({parts}, dim={self.dim})[{self.section}]"


@dataclass(frozen=True)
class Heads(Primitive):
    """`spec.heads(n_heads, d_head=None)`: the last axis `n_heads * d_head` becomes
    `(n_heads, d_head)`; `d_head` is inferred at read time (last_dim // n_heads)."""

    n_heads: int = 1
    d_head: int | None = None
    capability: str = "bijective_view"

    def _d_head(self, last: int) -> int:
        if self.d_head is not None:
            if self.n_heads * self.d_head != last:
                raise FacetError("facet_transform_invalid", f"{self.n_heads} heads of {self.d_head} do not cover a last "
                                 f"axis of {last}", remedy="pass the head count and head size the projection uses",
                                 n_heads=self.n_heads, d_head=self.d_head, last_dim=last)
            return self.d_head
        if last % self.n_heads:
            raise FacetError("facet_transform_invalid", f"{self.n_heads} heads do not divide a last axis of {last}",
                             remedy="pass d_head explicitly when the projection carries extra columns",
                             n_heads=self.n_heads, last_dim=last)
        return last // self.n_heads

    def apply(self, x: Any) -> Any:
        shape = tuple(x.shape)
        return x.reshape(shape[:-1] + (self.n_heads, self._d_head(shape[-1])))

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        return edited.reshape(tuple(parent.shape))

    def describe(self) -> str:
        return f".heads({self.n_heads}{'' if self.d_head is None else f', {self.d_head}'})"


@dataclass(frozen=True)
class Reshape(Primitive):
    """`spec.reshape(*shape)`: an exact view of the same elements."""

    shape: tuple[int, ...] = ()
    capability: str = "bijective_view"

    def apply(self, x: Any) -> Any:
        return x.reshape(self.shape)

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        return edited.reshape(tuple(parent.shape))

    def describe(self) -> str:
        return f".reshape{self.shape}"


@dataclass(frozen=True)
class Transpose(Primitive):
    """`spec.transpose(dim0, dim1)`."""

    dim0: int = 0
    dim1: int = 1
    capability: str = "bijective_view"

    def apply(self, x: Any) -> Any:
        return x.swapaxes(self.dim0, self.dim1)

    def scatter(self, parent: Any, edited: Any, ops: Any) -> Any:
        return edited.swapaxes(self.dim0, self.dim1)

    def describe(self) -> str:
        return f".transpose({self.dim0}, {self.dim1})"


@dataclass(frozen=True)
class AliasHead(Primitive):
    """A query-head index read through a grouped K/V projection: query head `index` reads
    K/V head `index // group` (PyTorch SDPA's enable_gqa repeat-interleave convention).
    Several query heads alias one K/V head, so it is read/grad only."""

    index: int = 0
    group: int = 1
    capability: str = "aliasing_selection"

    def apply(self, x: Any) -> Any:
        return x[(Ellipsis, self.index // self.group, slice(None))]

    def describe(self) -> str:
        return f".alias_head({self.index}, group={self.group})"


# the record ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FacetSpec:
    """ABI record of one facet: its home, transform chain, capability and provenance.

    `home_kind` is one of `HOME_KINDS`; `home` the op label (op / module_output /
    module_input homes resolve to the op that produced the value), parameter address, or
    None for computed facets; `slot` the output slot of a multi-output op; `call` the
    module call the recipe ran for. A computed facet holds `compute(trace) -> value` and the
    op labels it reads in `inputs` (each must be saved for the facet to be available now).
    """

    home_kind: str
    home: str | None = None
    slot: int | None = None
    call: int | None = None
    chain: tuple[Primitive, ...] = ()
    value_version: str = "raw"
    group: str | None = None
    recipe_id: str = ""
    recipe_version: str = "1"
    compute: Callable[[Any], Any] | None = field(default=None, compare=False)
    inputs: tuple[str, ...] = ()
    needs: str | None = None  # a reason this facet needs capture even when its inputs are saved
    grad_capable: bool = True
    address: str | None = None  # the module the home belongs to (module_output / module_input)

    def __post_init__(self) -> None:
        if self.home_kind not in HOME_KINDS:
            raise FacetError("facet_spec_invalid", f"home kind {self.home_kind!r} is not one of {HOME_KINDS}",
                             remedy="use op, module_output, module_input, parameter or computed", home_kind=self.home_kind)
        if self.home_kind == "computed" and self.compute is None:
            raise FacetError("facet_spec_invalid", "a computed facet needs compute=", remedy="pass compute=fn(trace)")

    # capability ---------------------------------------------------------------------------
    @property
    def capability(self) -> str:
        if self.home_kind == "computed":
            return "computed"
        return weakest([p.capability for p in self.chain] or ["bijective_view"])

    @property
    def writable(self) -> bool:
        return self.home_kind in ("op", "module_output", "module_input") and self.capability in WRITABLE

    @property
    def flags(self) -> dict[str, bool]:
        cap = self.capability
        return {"read": True, "grad": cap != "computed" and self.grad_capable and self.home_kind != "parameter",
                "write": self.writable and self.value_version == "raw"}

    # the primitive vocabulary (each returns a new spec) -----------------------------------
    def _then(self, prim: Primitive) -> "FacetSpec":
        if self.home_kind == "computed":
            raise FacetError("facet_spec_invalid", "a computed facet takes no further transform primitives",
                             remedy="compute the final value in the computed facet's function")
        return replace(self, chain=self.chain + (prim,))

    def __getitem__(self, key: Any) -> "FacetSpec":
        if self.chain and isinstance(self.chain[-1], _PendingSplit) and isinstance(key, int):
            pend = self.chain[-1]
            n = len(pend.sizes) if pend.sizes else pend.n_sections
            if not -n <= key < n:
                raise FacetError("facet_index_out_of_range", f"section {key} of a {n}-way split",
                                 remedy=f"use a section in 0..{n - 1}", index=key, size=n)
            return replace(self, chain=self.chain[:-1] + (Split(n_sections=pend.n_sections, dim=pend.dim, section=key % n, sizes=pend.sizes),))
        return self._then(Index(key=key))

    def heads(self, n_heads: int, d_head: int | None = None) -> "FacetSpec":
        if not isinstance(n_heads, int) or n_heads < 1:
            raise FacetError("facet_spec_invalid", f"heads() takes a positive head count, not {n_heads!r}",
                             remedy="pass the module's head count (tl.facets.config_value)", n_heads=n_heads)
        return self._then(Heads(n_heads=n_heads, d_head=d_head))

    def split(self, n_sections: Any, dim: int = -1) -> "FacetSpec":
        """`split(3)[i]` (equal sections) or `split([a, b, c])[i]` (sizes)."""
        if isinstance(n_sections, (list, tuple)):
            return self._then(_PendingSplit(n_sections=len(n_sections), dim=dim, sizes=tuple(int(s) for s in n_sections)))
        return self._then(_PendingSplit(n_sections=int(n_sections), dim=dim, sizes=None))

    def reshape(self, *shape: Any) -> "FacetSpec":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self._then(Reshape(shape=tuple(int(s) for s in shape)))

    def transpose(self, dim0: int, dim1: int) -> "FacetSpec":
        return self._then(Transpose(dim0=dim0, dim1=dim1))

    def select(self, dim: int, index: int) -> "FacetSpec":
        return self._then(Select(dim=dim, index=index))

    def alias_head(self, index: int, group: int) -> "FacetSpec":
        return self._then(AliasHead(index=index, group=group))

    # reading and writing -------------------------------------------------------------------
    def read(self, home_value: Any) -> Any:
        """Apply the chain to the home value."""
        self._check_pending()
        x = home_value
        for prim in self.chain:
            x = prim.apply(x)
        return x

    def scatter_update(self, home_value: Any, edited: Any, ops: Any = None) -> Any:
        """Write an edited facet value back into the full home value and return the edited
        home (dtype, device, shape and memory format of the home are kept)."""
        if not self.writable:
            raise FacetError("facet_write_refused", f"a {self.capability} facet (home {self.home_kind}) is not writable",
                             remedy="edit a bijective_view or selection facet whose home is an op output",
                             capability=self.capability)
        self._check_pending()
        # read forward, keeping every intermediate, then write back innermost first
        values = [home_value]
        for prim in self.chain:
            values.append(prim.apply(values[-1]))
        cur = edited
        for prim, parent in zip(reversed(self.chain), reversed(values[:-1])):
            cur = prim.scatter(parent, cur, ops)
        return cur

    def _check_pending(self) -> None:
        if any(isinstance(p, _PendingSplit) for p in self.chain):
            raise FacetError("facet_spec_invalid", "split(n) must be followed by [section]",
                             remedy="write spec.split(3, dim=-1)[0]")

    def describe(self) -> str:
        head = {"op": f"op {self.home}", "module_output": f"output of {self.address} ({self.home})",
                "module_input": f"input of {self.address} ({self.home})", "parameter": f"parameter {self.home}",
                "computed": "computed"}[self.home_kind]
        if self.slot is not None:
            head += f"[slot {self.slot}]"
        return head + "".join(p.describe() for p in self.chain) + f"  <{self.capability}>"


@dataclass(frozen=True)
class _PendingSplit(Primitive):
    """`split(n)` before its `[section]`: not readable on its own."""

    n_sections: int = 1
    dim: int = -1
    sizes: tuple[int, ...] | None = None
    capability: str = "selection"

    def apply(self, x: Any) -> Any:  # pragma: no cover - refused by _check_pending
        raise FacetError("facet_spec_invalid", "split(n) must be followed by [section]",
                         remedy="write spec.split(3, dim=-1)[0]")

    def describe(self) -> str:
        return f".split({self.n_sections}, dim={self.dim})"


def op_spec(label: str, *, slot: int | None = None, recipe_id: str = "", address: str | None = None,
            home_kind: str = "op", call: int | None = None) -> FacetSpec:
    """A spec whose home is one op's output (slot `slot` of a multi-output op)."""
    return FacetSpec(home_kind=home_kind, home=label, slot=slot, recipe_id=recipe_id, address=address, call=call)


def computed_spec(compute: Callable[[Any], Any], inputs: tuple[str, ...], *, recipe_id: str = "",
                  needs: str | None = None, address: str | None = None) -> FacetSpec:
    """A read-only facet computed from several homes (`inputs` are the op labels it reads)."""
    return FacetSpec(home_kind="computed", compute=compute, inputs=tuple(inputs), recipe_id=recipe_id, needs=needs,
                     address=address, grad_capable=False)


__all__ = ["FacetSpec", "Primitive", "Index", "Select", "Split", "Heads", "Reshape", "Transpose", "AliasHead",
           "CAPABILITIES", "WRITABLE", "HOME_KINDS", "weakest", "op_spec", "computed_spec"]
