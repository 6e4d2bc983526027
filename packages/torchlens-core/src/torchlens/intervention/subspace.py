"""Subspace edits: edit the component of a site's value inside the span of basis rows.

With Q the (orthonormalised) basis rows, a coordinate verb acts on c = x Q^T and the site
gets x + (edit(c) - c) Q; a value verb computes v = edit(x) and the site gets
x + (v - x) Q^T Q (its component along the span becomes v's); the source verb
`set_affine_coordinates(W, bias=b)` sets the coordinates to x W^T + b (LoReFT).
`tl.units(site, mask)` restricts any edit to the elements where `mask` is True.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchlens.errors import InterventionError
from torchlens.intervention import checks as C
from torchlens.intervention.edits import Edit, HookContext, _both, _builtin

#: Verbs that act on the coordinates c (the rest that are allowed act on values).
#: `add` (a scalar), `mean_ablate` (without source=) and `splice_module` (input_route="out")
#: are coordinate verbs too; `_kind` decides them from their arguments.
COORDINATE_VERBS = frozenset({"zero_ablate", "scale", "clamp", "add_noise", "scramble_elements", "hook"})
VALUE_VERBS = frozenset({"patch_from", "replace_with", "steer", "swap_with", "permute_batch", "resample_rows_from"})
SOURCE_VERBS = frozenset({"set_affine_coordinates"})
#: Verbs that depend on their arguments: coordinate or value (see `_kind`).
MIXED_VERBS = frozenset({"add", "mean_ablate", "splice_module"})
#: Verbs with no subspace form, each with the spelling that works instead.
_UNSUPPORTED = {
    "project_out": "project_out is itself a projection: apply it without tl.subspace, or use "
                   "do(tl.subspace(site, v[None], origin=...), tl.zero_ablate())",
    "project_onto": "project_onto is itself a projection: apply it without tl.subspace",
    "set_direction_mean": "set_direction_mean is itself a projection: apply it without tl.subspace",
    "subspace_ablate": "subspace_ablate is itself a projection: do(site, subspace_ablate(basis)) or "
                       "do(tl.subspace(site, basis, origin=...), tl.zero_ablate())",
    "subspace_interchange": "subspace_interchange is itself a projection: do(site, subspace_interchange(basis, donor)) "
                            "or do(tl.subspace(site, basis, origin=...), tl.patch_from(donor))",
    "subspace_edit": "a subspace edit is already projected: build one tl.subspace over the site",
    "compose": "apply the edits one at a time, each under its own do(tl.subspace(...), edit)",
    "positions": "restrict positions through within=: tl.subspace(tl.units(site, mask), basis, origin=...)",
    "at_positions": "restrict positions through within=: tl.subspace(tl.units(site, mask), basis, origin=...)",
    "units_edit": "restrict elements through within=: tl.subspace(tl.units(site, mask), basis, origin=...)",
}


def _host(v: Any) -> np.ndarray:
    """A basis, mask or source read on the host through its backend's `host_copy` (core calls
    no framework method on a value; `checks.to_numpy`)."""
    return C.to_numpy(v)


def orthonormal_rows(basis: Any, atol: float = 0.0) -> tuple[np.ndarray, bool]:
    """Float64 orthonormal rows spanning `basis`'s rows (Gram-Schmidt in row order, signs
    kept); the flag says whether the rows had to be changed."""
    try:
        b = np.asarray(_host(basis), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InterventionError("subspace_basis_invalid", f"a basis is a real [k, d] matrix; this one cannot be read as "
                                f"numbers ({type(exc).__name__})", remedy="pass basis rows, e.g. R[:k] of a learned rotation") from exc
    if b.ndim == 1:
        b = b[None, :]
    if b.ndim != 2 or b.shape[0] == 0:
        raise InterventionError("subspace_basis_invalid", f"a basis is a [k, d] matrix of rows, got shape {b.shape}",
                                remedy="pass basis rows, e.g. R[:k] of a learned rotation")
    if not np.all(np.isfinite(b)):
        raise InterventionError("subspace_basis_invalid", "the basis holds NaN or Inf", remedy="pass finite basis rows")
    b = np.where(np.abs(b) <= atol, 0.0, b)
    if np.allclose(b @ b.T, np.eye(b.shape[0]), atol=1e-6):
        return b, False
    rows = []
    for r in b:
        v = r.copy()
        for q in rows:
            v -= (v @ q) * q
        n = np.linalg.norm(v)
        if n <= 1e-10:
            raise InterventionError("subspace_basis_invalid", "the basis is rank-deficient",
                                    remedy="pass linearly independent rows", rows=int(b.shape[0]))
        rows.append(v / n)
    return np.stack(rows), True


@dataclass(frozen=True, eq=False)
class UnitsSite:
    """`tl.units(site, mask)`: the elements of a site where `mask` is True."""

    site: Any
    mask: Any

    def __repr__(self) -> str:
        return f"tl.units({self.site!r}, <mask {tuple(np.shape(_host(self.mask)))}>)"


@dataclass(frozen=True, eq=False)
class SubspaceSite:
    """`tl.subspace(site, basis, origin=...)`: the component of a site along basis rows."""

    site: Any
    basis: Any
    origin: str | None = None
    method: str | None = None
    atol: float = 0.0

    _tl_subspace = True

    def rows(self) -> tuple[np.ndarray, bool]:
        return orthonormal_rows(self.basis, self.atol)

    def support(self) -> np.ndarray:
        """The bound axis's elements a nonzero basis weight (above atol) touches."""
        b = np.asarray(_host(self.basis), dtype=np.float64)
        b = b[None, :] if b.ndim == 1 else b
        return np.any(np.abs(b) > self.atol, axis=0)

    def resolve(self, trace: Any) -> list["SupportSet"]:
        """The set question: per matched op, the elements where this edit can land (the
        basis's support along the last axis, within the tl.units mask when given)."""
        from torchlens.intervention.verbs import resolve_site

        inner = self.site.site if isinstance(self.site, UnitsSite) else self.site
        out = []
        for label in resolve_site(trace, inner):
            op = trace.ops[label]
            shape = tuple(getattr(op, "shape", None) or np.shape(op.out))
            sup = self.support()
            if not shape or shape[-1] != sup.shape[0]:
                raise InterventionError("subspace_basis_dim_mismatch", f"the basis rows have width {sup.shape[0]}; "
                                        f"{label} has shape {shape}", remedy="use basis rows as wide as the site's last axis",
                                        width=int(sup.shape[0]), site_shape=shape, label=label)
            mask = np.broadcast_to(sup, shape).copy()
            if isinstance(self.site, UnitsSite):
                mask &= np.broadcast_to(np.asarray(_host(self.site.mask), dtype=bool), shape)
            out.append(SupportSet(label, mask))
        return out

    def _composed(self, *_: Any) -> Any:
        raise InterventionError("subspace_projection_composed", f"{self!r} cannot be combined with | & - ~: a subspace "
                                "edits a component, not a set of elements",
                                remedy="to edit the support set itself, pass tl.units(site, resolved[0].mask) with "
                                "resolved = tl.subspace(...).resolve(trace)")

    __or__ = __ror__ = __and__ = __rand__ = __sub__ = __rsub__ = __invert__ = _composed

    def __repr__(self) -> str:
        return f"tl.subspace({self.site!r}, <basis {tuple(np.shape(_host(self.basis)))}>, origin={self.origin!r})"


@dataclass(frozen=True)
class SupportSet:
    """One entry of `tl.subspace(...).resolve(trace)`: the op `label` and the boolean `mask`
    (the op's shape) of the elements the subspace edit can touch."""

    label: str
    mask: np.ndarray


def units(site: Any, mask: Any) -> UnitsSite:
    """The elements of `site` where the boolean `mask` (broadcast to the site) is True."""
    try:
        m = _host(mask)
    except Exception as exc:  # not readable as an array
        raise C.bad("units", f"the mask cannot be read as an array ({type(exc).__name__})",
                    "pass a boolean tensor shaped like the site (or broadcastable to it)") from exc
    if m.dtype != np.bool_:
        raise C.bad("units", f"the mask has dtype {m.dtype}, not bool", "pass mask.bool() (True where the edit applies)")
    return UnitsSite(site, mask)


def _width_check(who: str, d: int) -> Any:
    def check(site: tuple) -> None:
        if not site or site[-1] != d:
            raise InterventionError("subspace_basis_dim_mismatch", f"{who}: the basis rows have width {d}; the site's last "
                                    f"axis is {site[-1] if site else 'missing'} (shape {site})",
                                    remedy="use basis rows as wide as the site's feature axis", width=d, site_shape=site)
    return check


def _mask_check(mask: Any) -> Any:
    shape = tuple(np.shape(_host(mask)))

    def check(site: tuple) -> None:
        C.broadcast_into("units", "mask", shape, site, False)
    return check


def subspace(site: Any, basis: Any, *, origin: str | None = None, method: str | None = None, atol: float = 0.0) -> SubspaceSite:
    if isinstance(site, SubspaceSite):
        raise InterventionError("subspace_projection_composed", "a subspace of a subspace has no meaning",
                                remedy="build one tl.subspace over the site")
    from torchlens.select.selection import Selection

    if isinstance(site, (Selection, SupportSet)) or (isinstance(site, (list, tuple)) and site
                                                     and all(isinstance(x, SupportSet) for x in site)):
        raise InterventionError("subspace_projection_composed", f"tl.subspace over an already resolved "
                                f"{type(site).__name__}", remedy="pass the selector or label itself, or "
                                "tl.units(site, resolved[0].mask) to edit a resolved support set")
    C.real("subspace", "atol", atol, low=0.0, remedy="atol= a finite number >= 0")
    for name, text in (("origin", origin), ("method", method)):
        if text is not None and not isinstance(text, str):
            raise C.bad("subspace", f"{name}= is text, not {type(text).__name__}", f"{name}='...' or None")
    orthonormal_rows(basis, atol)  # refuse a bad basis at construction
    sub = SubspaceSite(site, basis, origin, method, atol)
    if isinstance(site, UnitsSite):
        refuse_partial_axis(site.mask, sub.support())
    return sub


def refuse_partial_axis(mask: Any, support: np.ndarray) -> None:
    """interventions.md l. 98: under tl.subspace(tl.units(site, mask), basis) the mask picks
    whole positions: at each position (every index but the bound last axis) it must be True
    on every feature of the basis's support or on none of them. A mask covering only part
    of the support at a position has no projection meaning (the component along a basis row
    is not defined on half its features), so it refuses subspace_projection_partial_axis.
    A mask of width 1 on the last axis broadcasts over the features and always passes."""
    m = np.asarray(_host(mask), dtype=bool)
    d = int(support.shape[0])
    if m.ndim == 0 or m.shape[-1] == 1:
        return
    if m.shape[-1] != d:  # a mask of another width is refused by the staging check (edit_argument_shape_mismatch)
        return
    on = m[..., support]
    partial = np.any(on, axis=-1) & ~np.all(on, axis=-1)
    if np.any(partial):
        where = tuple(int(i) for i in np.argwhere(partial)[0])
        covered = int(np.count_nonzero(on[where]))
        raise InterventionError("subspace_projection_partial_axis", f"the tl.units mask covers {covered} of the "
                                f"{int(support.sum())} features the basis touches at position {where}: a subspace "
                                "edit restricted with tl.units picks whole positions",
                                remedy="make the mask True on every feature of each chosen position (e.g. "
                                "mask[..., :] = mask.any(-1, keepdims=True)), or edit elements directly with "
                                "do(tl.units(site, mask), edit) without tl.subspace", position=where,
                                covered=covered, support=int(support.sum()))


def _affine_array(name: str, v: Any, ndim: int, remedy: str) -> np.ndarray:
    """A finite real (int or float, never bool or complex) array of `ndim` axes, or
    affine_source_invalid."""
    try:
        arr = np.asarray(_host(v))
    except Exception as exc:  # not readable as an array at all
        raise InterventionError("affine_source_invalid", f"set_affine_coordinates: {name} cannot be read as an array "
                                f"({type(exc).__name__})", remedy=remedy, argument=name) from exc
    real = (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)) and arr.dtype != np.bool_
    if v is None or isinstance(v, (str, bytes, bool)) or not real or arr.ndim != ndim or 0 in arr.shape:
        raise InterventionError("affine_source_invalid", f"set_affine_coordinates: {name} must be a finite real "
                                f"{ndim}-d tensor, got {type(v).__name__} of shape {arr.shape} ({arr.dtype})",
                                remedy=remedy, argument=name, shape=tuple(arr.shape), dtype=str(arr.dtype))
    if not np.all(np.isfinite(arr)):
        raise InterventionError("affine_source_invalid", f"set_affine_coordinates: {name} holds NaN or Inf",
                                remedy=remedy, argument=name)
    return arr


def set_affine_coordinates(weight: Any, *, bias: Any = None) -> Edit:
    """The LoReFT source verb: under `tl.subspace(site, R.T)`, set the coordinates to W x + b.
    `weight` is a finite real [k, d] tensor shaped like the basis rows; `bias` None or a
    finite real [k] tensor; anything else raises affine_source_invalid."""
    w = _affine_array("weight", weight, 2, "pass W, a finite real [k, d] tensor shaped like the basis rows")
    if bias is not None:
        b = _affine_array("bias", bias, 1, f"pass b, a finite real [{w.shape[0]}] tensor (one per weight row), or None")
        if b.shape != (w.shape[0],):
            raise InterventionError("affine_source_invalid", f"bias must be None or a finite real [{w.shape[0]}] tensor, "
                                    f"got shape {b.shape} ({b.dtype})", remedy="pass b of shape [k] (one per weight row)")

    def outside(v: Any, ctx: HookContext) -> Any:
        raise InterventionError("affine_source_needs_subspace", "a [k, d] affine map only has meaning inside a subspace",
                                remedy="trace.do(tl.subspace(site, R.T, origin=...), tl.intervention.set_affine_coordinates(W, bias=b))")

    return _builtin(Edit("set_affine_coordinates", (("weight", weight), ("bias", bias)), outside,
                         tensors=tuple(t for t in (weight, bias) if t is not None)))


def subspace_edit(sub: SubspaceSite, verb: Edit, mask: Any = None) -> Edit:
    """The builtin `subspace_edit`: `verb` applied to the component of the value along
    `sub`'s rows (restricted to `mask` when given)."""
    q64, changed = sub.rows()
    raw = np.asarray(_host(sub.basis))
    return subspace_edit_from_rows(q64, verb, mask=mask, origin=sub.origin, method=sub.method, orthonormalised=changed,
                                   basis=sub.basis, basis_sha256=array_sha256(raw), basis_dtype=str(raw.dtype))


def array_sha256(v: Any) -> str:
    """sha256 of an array's dtype, shape and bytes (a basis or a mask, read on the host)."""
    arr = np.ascontiguousarray(_host(v))
    h = hashlib.sha256()
    h.update(str(arr.dtype).encode())
    h.update(str(arr.shape).encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def subspace_edit_from_rows(q64: np.ndarray, verb: Edit, *, mask: Any = None, origin: str | None = None,
                            method: str | None = None, orthonormalised: bool = False, basis: Any = None,
                            basis_sha256: str | None = None, basis_dtype: str | None = None) -> Edit:
    """`subspace_edit` over float64 orthonormal rows `q64` (also how a saved spec is rebuilt)."""
    refuse_unsupported(verb)
    if verb.name == "set_affine_coordinates":
        w = np.asarray(_host(dict(verb.kwargs)["weight"]))
        if w.shape != q64.shape:
            raise InterventionError("affine_source_invalid", f"W has shape {w.shape}; the basis rows have {q64.shape}",
                                    remedy="W and the basis rows must both be [k, d]")
    rows_sha = hashlib.sha256(np.ascontiguousarray(q64).tobytes()).hexdigest()

    def fn(x: Any, ctx: HookContext) -> Any:
        ops = ctx.ops
        q = ops.asarray(q64, x)
        c = x @ q.T
        kind = _kind(verb)
        if kind == "coordinate":
            new_c = verb(c, ctx)
            out = x + (new_c - c) @ q
        elif kind == "source":
            kw = dict(verb.kwargs)
            w = ops.asarray(kw["weight"], x)
            new_c = x @ w.T
            if kw.get("bias") is not None:
                new_c = new_c + ops.asarray(kw["bias"], x)
            out = x + (new_c - c) @ q
        else:
            v = verb(x, ctx)
            out = x + ((v - x) @ q.T) @ q
        if mask is not None:
            m = ops.asarray(_host(mask), None) if not hasattr(mask, "shape") else mask
            out = ops.where(m, out, x)
        return out

    kwargs = (("verb", verb.name), ("verb_kwargs", verb.kwargs), ("rows_sha256", rows_sha), ("origin", origin),
              ("method", method), ("orthonormalised", orthonormalised), ("rows", q64), ("axis", -1),
              ("basis_sha256", basis_sha256), ("basis_dtype", basis_dtype))
    if mask is not None:
        kwargs += (("mask", mask), ("mask_sha256", array_sha256(mask)))
    tensors = ((basis,) if basis is not None else ()) + verb.tensors
    check = _both(_width_check("subspace_edit", int(q64.shape[1])), None if mask is None else _mask_check(mask),
                  verb.check if _kind(verb) == "value" else None)
    return _keep_extra(verb, _builtin(Edit("subspace_edit", kwargs, fn, portability=verb.portability, signal=verb.signal,
                                           tensors=tensors, check=check), trusted=verb.trusted))


def _keep_extra(verb: Edit, wrapped: Edit) -> Edit:
    """The wrapper keeps the audit facts of the verb it applies (a Population mean: stochastic=False)."""
    if verb.audit_extra:
        object.__setattr__(wrapped, "_audit_extra", verb.audit_extra)
    return wrapped


def units_edit(mask: Any, verb: Edit) -> Edit:
    """`verb` applied only where `mask` is True."""

    def fn(x: Any, ctx: HookContext) -> Any:
        m = mask if hasattr(mask, "shape") and not isinstance(mask, np.ndarray) else ctx.ops.asarray(_host(mask), None)
        return ctx.ops.where(m, verb(x, ctx), x)

    return _keep_extra(verb, _builtin(Edit("units_edit", (("verb", verb.name), ("verb_kwargs", verb.kwargs),
                                                         ("mask", mask), ("mask_sha256", array_sha256(mask))), fn,
                                           portability=verb.portability, signal=verb.signal, tensors=(mask,) + verb.tensors,
                                           check=_both(_mask_check(mask), verb.check)), trusted=verb.trusted))


def _kind(verb: Edit) -> str:
    """"source", "coordinate" or "value": how `verb` acts inside a subspace."""
    if verb.name in SOURCE_VERBS:
        return "source"
    if verb.name in COORDINATE_VERBS:
        return "coordinate"
    kw = dict(verb.kwargs)
    if verb.name == "add":
        return "coordinate" if isinstance(kw["value"], (int, float)) else "value"
    if verb.name == "mean_ablate":
        return "coordinate" if kw.get("source") is None else "value"
    if verb.name == "splice_module":
        return "coordinate"  # input_route="out" (input_route="in" is refused before this)
    return "value"


def refuse_unsupported(verb: Edit) -> None:
    """subspace_edit_unsupported, naming the spelling that works, for a verb with no subspace form."""
    kw = dict(verb.kwargs)
    if verb.name in _UNSUPPORTED:
        remedy = _UNSUPPORTED[verb.name]
    elif verb.name == "splice_module" and kw.get("input_route") != "out":
        remedy = "splice_module(module, input_route='out') acts on the coordinates"
    elif verb.name == "scramble_elements" and kw.get("source") is not None:  # interventions.md l. 91: coordinate
        remedy = ("scramble_elements acts on the coordinates only without source=: use scramble_elements(seed=...) "
                  "under tl.subspace, or apply scramble_elements(seed=..., source=t) to the whole site")
    elif verb.name == "mean_ablate" and hasattr(kw.get("source"), "out"):
        remedy = "a source= that is an activation value has no subspace form: pass its tensor (op.out) as the source"
    elif verb.signal == "backward":
        remedy = "a backward verb edits gradients: use it on tl.grad(site) without tl.subspace"
    elif verb.name in COORDINATE_VERBS | VALUE_VERBS | SOURCE_VERBS | MIXED_VERBS:
        return
    else:
        remedy = ("use a coordinate verb (zero_ablate, scale, clamp, add_noise, mean_ablate(dim=...), add(scalar), "
                  "scramble_elements, splice_module(m, input_route='out'), a hook) or a value verb (patch_from, "
                  "replace_with, swap_with, add(tensor), steer)")
    raise InterventionError("subspace_edit_unsupported", f"{verb.name} has no subspace form", remedy=remedy, verb=verb.name)


def lower(site: Any, edit: Edit) -> tuple[Any, Edit, str]:
    """(plain site, edit to apply, audit source) for a subspace / units site."""
    if isinstance(site, SubspaceSite):
        inner, mask = site.site, None
        if isinstance(inner, UnitsSite):
            refuse_partial_axis(inner.mask, site.support())  # also for a SubspaceSite built without tl.subspace
            inner, mask = inner.site, inner.mask
        return inner, subspace_edit(site, edit, mask), f"projection:{site.origin or 'unnamed basis'}"
    if edit.name in SOURCE_VERBS:
        raise InterventionError("affine_source_needs_subspace", f"{edit.name} maps the whole site value to subspace "
                                f"coordinates; {site!r} is not a tl.subspace", remedy="trace.do(tl.subspace(site, R.T, "
                                "origin=...), tl.intervention.set_affine_coordinates(W, bias=b))", site=repr(site))
    if isinstance(site, UnitsSite):
        return site.site, units_edit(site.mask, edit), "units"
    return site, edit, "direct"


_ABLATE_MODES = ("zero", "mean", "resample")


def _mode_invalid(message: str, remedy: str, **fields: Any) -> InterventionError:
    return InterventionError("subspace_mode_invalid", f"subspace_ablate: {message}", remedy=remedy, helper="subspace_ablate",
                             **fields)


def _axis_width_check(who: str, d: int, dim: int) -> Any:
    """The basis rows act on axis `dim` of the site: its length must be the row width `d`."""
    def check(site: tuple) -> None:
        ok = bool(site) and -len(site) <= dim < len(site)
        if not ok or site[dim] != d:
            raise InterventionError("subspace_basis_dim_mismatch", f"{who}: the basis rows have width {d}; axis {dim} of "
                                    f"the site is {site[dim] if ok else 'missing'} (shape {site})",
                                    remedy=f"use basis rows as wide as axis {dim} of the site, or pass dim= naming an "
                                    f"axis of length {d}", width=d, dim=dim, site_shape=site)
    return check


def _on_axis(x: Any, ops: Any, dim: int, body: Any) -> Any:
    """Apply `body` (acting on the last axis) with axis `dim` of `x` moved last and back."""
    if dim in (-1, len(x.shape) - 1):
        return body(x)
    return ops.moveaxis(body(ops.moveaxis(x, dim, -1)), -1, dim)


def subspace_ablate(basis: Any, *, mode: str = "zero", dim: int = -1, mean: Any = None, seed: int | None = None) -> Edit:
    """Edit the component of the value inside the span of `basis` ([k, d] rows, not
    necessarily orthonormal) along axis `dim`; with P the orthogonal projector onto the span:
    mode="zero" gives x - P x, mode="mean" gives x - P x + P mean (mean= a [d] tensor),
    mode="resample" gives x - P x + P x[perm] for a batch permutation drawn from seed=."""
    q64, _ = orthonormal_rows(basis)
    if not isinstance(mode, str) or mode not in _ABLATE_MODES:
        raise _mode_invalid(f"mode={mode!r} is not one of {_ABLATE_MODES}", "mode='zero', 'mean' or 'resample'",
                            mode=repr(mode))
    d_axis = C.integer("subspace_ablate", "dim", dim, remedy="dim= the axis the basis rows act on (an int; -1 by default)")
    if mode == "mean" and mean is None:
        raise _mode_invalid("mode='mean' needs mean= (the [d] value whose component is written back)",
                            "subspace_ablate(basis, mode='mean', mean=mu)", mode=mode)
    if mode != "mean" and mean is not None:
        raise _mode_invalid(f"mean= only applies to mode='mean', not mode={mode!r}", "drop mean= or pass mode='mean'",
                            mode=mode)
    if mode == "resample" and seed is None:
        raise _mode_invalid("mode='resample' needs seed= (the batch permutation is drawn from it)",
                            "subspace_ablate(basis, mode='resample', seed=0)", mode=mode)
    if mode != "resample" and seed is not None:
        raise _mode_invalid(f"seed= only applies to mode='resample', not mode={mode!r}", "drop seed= or pass mode='resample'",
                            mode=mode)
    width = int(q64.shape[1])
    mean64 = None
    if mean is not None:
        shape = C.tensor("subspace_ablate", "mean", mean, remedy=f"mean= a finite real [{width}] tensor",
                         code="subspace_mode_invalid")
        if shape != (width,):
            raise _mode_invalid(f"mean= has shape {shape}; the basis rows have width {width}",
                                f"pass a [{width}] mean", mode=mode, mean_shape=shape)
        mean64 = np.asarray(_host(mean), dtype=np.float64)
    if seed is not None:
        C.integer("subspace_ablate", "seed", seed, low=0, high=2**63 - 1, remedy="seed= a non-negative int",
                  code="subspace_mode_invalid")

    def fn(x: Any, ctx: HookContext) -> Any:
        ops = ctx.ops

        def body(v: Any) -> Any:
            q = ops.asarray(q64, v)
            out = v - (v @ q.T) @ q
            if mode == "mean":
                m = ops.asarray(mean64, v)
                out = out + (m @ q.T) @ q
            elif mode == "resample":
                perm = np.random.default_rng(int(seed)).permutation(int(v.shape[0]))
                donor = v[ops.asarray(perm, None)]
                out = out + (donor @ q.T) @ q
            return out

        return _on_axis(x, ops, d_axis, body)

    kwargs = (("rows", q64), ("mode", mode), ("dim", dim), ("mean", mean), ("seed", seed))
    return _builtin(Edit("subspace_ablate", kwargs, fn, tensors=(basis,) + (() if mean is None else (mean,)),
                         check=_axis_width_check("subspace_ablate", width, d_axis)))


def subspace_interchange(basis: Any, source: Any, *, dim: int = -1) -> Edit:
    """x - P x + P s: give the value the donor trace's component inside the span of `basis`
    rows along axis `dim`, keeping its own orthogonal complement (the distributed-alignment
    interchange; the donor value s is the source trace's value at the same site)."""
    if not (hasattr(source, "ops") and hasattr(source, "find_sites")):
        raise InterventionError("patch_source_invalid", f"subspace_interchange needs a donor trace, not {type(source).__name__}",
                                remedy="subspace_interchange(basis, donor_trace, dim=-1)")
    q64, _ = orthonormal_rows(basis)
    d_axis = C.integer("subspace_interchange", "dim", dim, remedy="dim= the axis the basis rows act on (an int)")

    def fn(x: Any, ctx: HookContext) -> Any:
        ops = ctx.ops
        try:
            donor = ops.asarray(source.ops[ctx.label].out, x)
        except KeyError as exc:
            raise InterventionError("patch_source_invalid", f"the donor trace has no op {ctx.label!r}",
                                    remedy="interchange between traces of the same model") from exc
        if tuple(donor.shape) != tuple(x.shape):
            raise InterventionError("patch_source_invalid", f"the donor value at {ctx.label} has shape {tuple(donor.shape)}, "
                                    f"the site {tuple(x.shape)}", remedy="interchange between runs of matching shape",
                                    label=ctx.label)
        q = ops.asarray(q64, x)
        xs, ds = (x, donor) if d_axis in (-1, len(x.shape) - 1) else (ops.moveaxis(x, d_axis, -1), ops.moveaxis(donor, d_axis, -1))
        out = xs + ((ds - xs) @ q.T) @ q
        return out if xs is x else ops.moveaxis(out, -1, d_axis)

    return _builtin(Edit("subspace_interchange", (("source", f"<trace {getattr(source, 'name', '?')}>"), ("rows", q64),
                                                  ("dim", dim)), fn,
                         portability="session", signal="forward", tensors=(basis,),
                         check=_axis_width_check("subspace_interchange", int(q64.shape[1]), d_axis)))
