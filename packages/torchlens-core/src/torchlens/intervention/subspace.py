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
COORDINATE_VERBS = frozenset({"zero_ablate", "scale", "clamp", "add_noise", "scramble_elements", "hook"})
VALUE_VERBS = frozenset({"patch_from", "replace_with", "steer", "mean_ablate", "swap_with"})
SOURCE_VERBS = frozenset({"set_affine_coordinates"})


def _host(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    detach = getattr(v, "detach", None)
    if detach is not None:
        v = detach().cpu()
        if str(v.dtype) == "torch.bfloat16":
            v = v.float()
        return v.numpy()
    return np.asarray(v)


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

    def rows(self) -> tuple[np.ndarray, bool]:
        return orthonormal_rows(self.basis, self.atol)

    def __repr__(self) -> str:
        return f"tl.subspace({self.site!r}, <basis {tuple(np.shape(_host(self.basis)))}>, origin={self.origin!r})"


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
    C.real("subspace", "atol", atol, low=0.0, remedy="atol= a finite number >= 0")
    for name, text in (("origin", origin), ("method", method)):
        if text is not None and not isinstance(text, str):
            raise C.bad("subspace", f"{name}= is text, not {type(text).__name__}", f"{name}='...' or None")
    orthonormal_rows(basis, atol)  # refuse a bad basis at construction
    return SubspaceSite(site, basis, origin, method, atol)


def set_affine_coordinates(weight: Any, *, bias: Any = None) -> Edit:
    """The LoReFT source verb: under `tl.subspace(site, R.T)`, set the coordinates to W x + b."""
    w = _host(weight)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating) or not np.all(np.isfinite(w)):
        raise InterventionError("affine_source_invalid", "set_affine_coordinates needs a finite float [k, d] weight",
                                remedy="pass W of shape [k, d]")
    if bias is not None:
        b = _host(bias)
        if b.shape != (w.shape[0],) or not np.issubdtype(b.dtype, np.floating) or not np.all(np.isfinite(b)):
            raise InterventionError("affine_source_invalid", f"bias must be None or a finite float [{w.shape[0]}] tensor, "
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
    return subspace_edit_from_rows(q64, verb, mask=mask, origin=sub.origin, method=sub.method, orthonormalised=changed,
                                   basis=sub.basis)


def subspace_edit_from_rows(q64: np.ndarray, verb: Edit, *, mask: Any = None, origin: str | None = None,
                            method: str | None = None, orthonormalised: bool = False, basis: Any = None) -> Edit:
    """`subspace_edit` over float64 orthonormal rows `q64` (also how a saved spec is rebuilt)."""
    if verb.name not in COORDINATE_VERBS | VALUE_VERBS | SOURCE_VERBS and not (verb.name == "add"):
        raise InterventionError("subspace_edit_unsupported", f"{verb.name} has no subspace form",
                                remedy="apply it without tl.subspace, or use a coordinate or value verb")
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
              ("method", method), ("orthonormalised", orthonormalised), ("rows", q64))
    if mask is not None:
        kwargs += (("mask", mask),)
    tensors = ((basis,) if basis is not None else ()) + verb.tensors
    check = _both(_width_check("subspace_edit", int(q64.shape[1])), None if mask is None else _mask_check(mask),
                  verb.check if _kind(verb) == "value" else None)
    return _builtin(Edit("subspace_edit", kwargs, fn, portability=verb.portability, signal=verb.signal, tensors=tensors,
                         check=check), trusted=verb.trusted)


def units_edit(mask: Any, verb: Edit) -> Edit:
    """`verb` applied only where `mask` is True."""

    def fn(x: Any, ctx: HookContext) -> Any:
        m = mask if hasattr(mask, "shape") and not isinstance(mask, np.ndarray) else ctx.ops.asarray(_host(mask), None)
        return ctx.ops.where(m, verb(x, ctx), x)

    return _builtin(Edit("units_edit", (("verb", verb.name), ("verb_kwargs", verb.kwargs), ("mask", mask)), fn,
                         portability=verb.portability, signal=verb.signal, tensors=(mask,) + verb.tensors,
                         check=_both(_mask_check(mask), verb.check)), trusted=verb.trusted)


def _kind(verb: Edit) -> str:
    if verb.name in SOURCE_VERBS:
        return "source"
    if verb.name in COORDINATE_VERBS:
        return "coordinate"
    if verb.name == "add":
        v = dict(verb.kwargs)["value"]
        return "coordinate" if isinstance(v, (int, float)) else "value"
    return "value"


def lower(site: Any, edit: Edit) -> tuple[Any, Edit, str]:
    """(plain site, edit to apply, audit source) for a subspace / units site."""
    if isinstance(site, SubspaceSite):
        inner, mask = site.site, None
        if isinstance(inner, UnitsSite):
            inner, mask = inner.site, inner.mask
        return inner, subspace_edit(site, edit, mask), f"projection:{site.origin or 'unnamed basis'}"
    if isinstance(site, UnitsSite):
        return site.site, units_edit(site.mask, edit), "units"
    return site, edit, "direct"


def subspace_ablate(basis: Any, *, atol: float = 0.0) -> Edit:
    """Remove the component of the value inside the span of `basis` rows (last axis)."""
    q64, _ = orthonormal_rows(basis, atol)

    def fn(x: Any, ctx: HookContext) -> Any:
        q = ctx.ops.asarray(q64, x)
        return x - (x @ q.T) @ q

    return _builtin(Edit("subspace_ablate", (("rows", q64),), fn, tensors=(basis,),
                         check=_width_check("subspace_ablate", int(q64.shape[1]))))


def subspace_interchange(source: Any, basis: Any, *, atol: float = 0.0) -> Edit:
    """Give the value the donor trace's component inside the span of `basis` rows, keeping
    its own orthogonal complement (the distributed-alignment interchange)."""
    if not (hasattr(source, "ops") and hasattr(source, "find_sites")):
        raise InterventionError("patch_source_invalid", f"subspace_interchange needs a donor trace, not {type(source).__name__}",
                                remedy="subspace_interchange(donor_trace, basis)")
    q64, _ = orthonormal_rows(basis, atol)

    def fn(x: Any, ctx: HookContext) -> Any:
        q = ctx.ops.asarray(q64, x)
        donor = source.ops[ctx.label].out
        return x + ((ctx.ops.asarray(donor, x) - x) @ q.T) @ q

    return _builtin(Edit("subspace_interchange", (("source", f"<trace {getattr(source, 'name', '?')}>"), ("rows", q64)), fn,
                         portability="session", signal="forward", tensors=(basis,),
                         check=_width_check("subspace_interchange", int(q64.shape[1]))))
