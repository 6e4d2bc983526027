"""Edits: what an intervention does to the value at a site.

An `Edit` is a frozen description (name, arguments) plus the function that applies it. The
math runs through the backend's edit ops (`backend.edit_ops()`: `zeros_like`, `clip`,
`mean`, `norm`, `randn_like`, `moveaxis`, `asarray`, `clone`, `permute_flat`), so the
same helper works on torch tensors and numpy arrays alike, and core imports no framework.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from torchlens.errors import AmbiguousAxisError, InterventionError


@dataclass
class HookContext:
    """What a hook callable `fn(value, *, ctx)` may read about the site it edits."""

    label: str
    op: Any
    trace: Any
    ops: Any
    signal: str = "forward"
    state: dict = field(default_factory=dict)
    run_state: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Edit:
    """An edit helper: `name` and `kwargs` identify it; `fn(value, ctx)` applies it.

    `portability` is "builtin" for the named helpers and "callable" for user hooks;
    `signal` is None for neutral edits and "forward" for edits that read recorded forward
    state (patch_from, mean_ablate, splice_module).
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...]
    fn: Callable[[Any, HookContext], Any]
    portability: str = "builtin"
    signal: str | None = None
    allow_shape_change: bool = False
    tensors: tuple[Any, ...] = ()

    def __call__(self, value: Any, ctx: HookContext) -> Any:
        return self.fn(value, ctx)

    def identity(self) -> str:
        """A stable text identity (used by Recipe.digest and duplicate checks)."""
        parts = [self.name]
        for k, v in self.kwargs:
            parts.append(f"{k}={_value_identity(v)}")
        return "(".join([parts[0], ", ".join(parts[1:])]) + ")"

    def __repr__(self) -> str:
        return f"tl.{self.identity()}"


def _value_identity(v: Any) -> str:
    if isinstance(v, (int, float, str, bool, type(None))):
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(_value_identity(x) for x in v) + ")"
    shape = getattr(v, "shape", None)
    if shape is not None:
        return f"<tensor {tuple(shape)} sha256:{tensor_digest(v)[:16]}>"
    return f"<{type(v).__name__}>"


def tensor_digest(v: Any) -> str:
    """sha256 of a tensor's content (via numpy, without importing a framework)."""
    import numpy as np

    arr = v
    if not isinstance(v, np.ndarray):
        detach = getattr(v, "detach", None)
        if detach is not None:
            v = detach()
            if str(getattr(v, "dtype", "")) == "torch.bfloat16":
                v = v.float()
            v = v.cpu().numpy() if hasattr(v, "cpu") else v
        arr = np.asarray(v)
    h = hashlib.sha256()
    h.update(str(arr.dtype).encode())
    h.update(str(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _axis(value: Any, n: int, dim: int | None, who: str) -> int:
    shape = tuple(value.shape)
    if dim is not None:
        return dim % len(shape)
    matches = [i for i, s in enumerate(shape) if s == n]
    if len(matches) != 1:
        raise AmbiguousAxisError("axis_ambiguous", f"{who}: a direction of length {n} matches axes {matches} of shape {shape}",
                                 remedy=f"pass dim= (one of {matches or list(range(len(shape)))})", matching_dims=matches,
                                 shape=shape)
    return matches[0]


# helpers ---------------------------------------------------------------------------------

def zero_ablate(*, allow_shape_change: bool = False) -> Edit:
    """Set the site to zeros."""
    return Edit("zero_ablate", (), lambda v, ctx: ctx.ops.zeros_like(v), allow_shape_change=allow_shape_change)


def scale(factor: float, *, allow_shape_change: bool = False) -> Edit:
    """Multiply the site by `factor`."""
    return Edit("scale", (("factor", factor),), lambda v, ctx: v * factor, allow_shape_change=allow_shape_change)


def add(value: Any, *, allow_shape_change: bool = False) -> Edit:
    """Add a scalar or a broadcastable tensor."""
    tensors = () if isinstance(value, (int, float)) else (value,)
    return Edit("add", (("value", value),), lambda v, ctx: v + ctx.ops.asarray(value, v), tensors=tensors,
                allow_shape_change=allow_shape_change)


def clamp(min: float | None = None, max: float | None = None, *, allow_shape_change: bool = False) -> Edit:  # noqa: A002
    """Clip the site to [min, max]."""
    if min is None and max is None:
        raise InterventionError("intervention_edit_invalid", "clamp needs min= or max=", remedy="tl.clamp(min=0.0)")
    return Edit("clamp", (("min", min), ("max", max)), lambda v, ctx: ctx.ops.clip(v, min, max),
                allow_shape_change=allow_shape_change)


def add_noise(std: float = 1.0, *, seed: int = 0, allow_shape_change: bool = False) -> Edit:
    """Add Gaussian noise with standard deviation `std`, drawn from its own seeded stream."""
    return Edit("add_noise", (("std", std), ("seed", seed)), lambda v, ctx: v + ctx.ops.randn_like(v, seed) * std,
                allow_shape_change=allow_shape_change)


def mean_ablate(source: Any = None, *, dim: Any, allow_shape_change: bool = False) -> Edit:
    """Fill the site with a mean over `dim` (None: every axis) of `source` (default: the site)."""
    if not (dim is None or isinstance(dim, int) or (isinstance(dim, tuple) and all(isinstance(d, int) for d in dim))):
        raise InterventionError("intervention_over_invalid", f"mean_ablate(dim={dim!r}) is not None, an int or a tuple of ints",
                                remedy="mean_ablate(dim=0) averages over the batch axis", dim=repr(dim))

    def fn(v, ctx):
        src = v if source is None else _source_value(source, ctx)
        m = ctx.ops.mean(src, dim, True)
        return ctx.ops.zeros_like(v) + m

    tensors = () if source is None or not hasattr(source, "shape") else (source,)
    return Edit("mean_ablate", (("source", source), ("dim", dim)), fn, signal="forward", tensors=tensors,
                allow_shape_change=allow_shape_change)


def replace_with(value: Any, *, allow_shape_change: bool = False) -> Edit:
    """Set the site to a fixed value (a tensor or a scalar)."""
    if isinstance(value, (int, float)):
        return Edit("replace_with", (("value", value),), lambda v, ctx: ctx.ops.zeros_like(v) + value,
                    allow_shape_change=allow_shape_change)
    return Edit("replace_with", (("value", value),), lambda v, ctx: ctx.ops.clone(ctx.ops.asarray(value, v)),
                tensors=(value,), allow_shape_change=allow_shape_change)


def steer(direction: Any, strength: float = 1.0, *, dim: int | None = None, allow_shape_change: bool = False) -> Edit:
    """Add `strength * direction` along axis `dim` (inferred when exactly one axis fits)."""

    def fn(v, ctx):
        d = ctx.ops.asarray(direction, v)
        axis = _axis(v, int(d.shape[-1]), dim, "steer") if len(d.shape) == 1 else None
        if axis is None:
            return v + d * strength
        moved = ctx.ops.moveaxis(v, axis, -1)
        return ctx.ops.moveaxis(moved + d * strength, -1, axis)

    return Edit("steer", (("direction", direction), ("strength", strength), ("dim", dim)), fn, tensors=(direction,),
                allow_shape_change=allow_shape_change)


def _projection(direction: Any, dim: int | None, keep: bool, name: str) -> Edit:
    def fn(v, ctx):
        d = ctx.ops.asarray(direction, v)
        if len(d.shape) != 1:
            raise InterventionError("steer_direction_invalid", f"{name} needs a 1-d direction, got shape {tuple(d.shape)}",
                                    remedy="pass a vector")
        u = d / ctx.ops.norm(d, None, False)
        axis = _axis(v, int(d.shape[0]), dim, name)
        moved = ctx.ops.moveaxis(v, axis, -1)
        coeff = moved @ u
        along = coeff[..., None] * u
        out = along if keep else moved - along
        return ctx.ops.moveaxis(out, -1, axis)

    return Edit(name, (("direction", direction), ("dim", dim)), fn, tensors=(direction,))


def project_onto(direction: Any, *, dim: int | None = None) -> Edit:
    """Keep only the component along `direction`."""
    return _projection(direction, dim, True, "project_onto")


def project_out(direction: Any, *, dim: int | None = None) -> Edit:
    """Remove the component along `direction`."""
    return _projection(direction, dim, False, "project_out")


def clip_norm(max_norm: float, norm_type: float = 2.0) -> Edit:
    """Rescale the whole tensor so its `norm_type` norm is at most `max_norm`."""

    def fn(v, ctx):
        n = ctx.ops.norm(v, None, False, norm_type)
        factor = ctx.ops.clip(max_norm / (n + 1e-12), None, 1.0)
        return v * factor

    return Edit("clip_norm", (("max_norm", max_norm), ("norm_type", norm_type)), fn)


def patch_from(source: Any, *, site: Any = None) -> Edit:
    """Replace the site with the value a donor trace recorded at the same label (or `site`)."""

    def fn(v, ctx):
        key = site if site is not None else ctx.label
        try:
            donor = source.ops[key] if isinstance(key, str) else source.find_sites(key).first()
        except KeyError as exc:
            raise InterventionError("patch_source_invalid", f"the donor trace has no op {key!r}",
                                    remedy="patch between traces of the same model, or pass site=") from exc
        return ctx.ops.clone(donor.out)

    return Edit("patch_from", (("source", f"<trace {getattr(source, 'name', '?')}>"), ("site", repr(site))), fn,
                signal="forward", portability="session")


def swap_with(donor: Any) -> Edit:
    """Replace the site with a fixed donor tensor (portable), or a donor trace's value."""
    if hasattr(donor, "ops") and hasattr(donor, "find_sites"):
        return patch_from(donor)
    return replace_with(donor)


def scramble_elements(seed: int = 0) -> Edit:
    """Replace the site with an iid scramble of its own flattened elements."""
    return Edit("scramble_elements", (("seed", seed),), lambda v, ctx: ctx.ops.permute_flat(v, seed))


def hook(fn: Callable[..., Any]) -> Edit:
    """Wrap a hook callable `fn(value, *, ctx)`; it may return a new value or None (keep)."""
    if not callable(fn):
        raise InterventionError("intervention_edit_invalid", f"{type(fn).__name__} is not callable",
                                remedy="pass a helper such as tl.zero_ablate() or a function fn(t, *, ctx)")

    def apply(v, ctx):
        out = fn(v, ctx=ctx)
        return v if out is None else out

    name = getattr(fn, "__qualname__", type(fn).__name__)
    return Edit("hook", (("fn", name),), apply, portability="callable")


def _source_value(source: Any, ctx: HookContext) -> Any:
    if hasattr(source, "out"):
        return source.out
    return ctx.ops.asarray(source, None)


def as_edit(obj: Any) -> Edit:
    """An Edit as-is; a callable as a hook; any other value as `replace_with(value)`."""
    if isinstance(obj, Edit):
        return obj
    if callable(obj):
        return hook(obj)
    if obj is None:
        raise InterventionError("intervention_edit_invalid", "None is not an edit",
                                remedy="pass a helper such as tl.zero_ablate(), a hook callable or a value")
    return replace_with(obj)


def splice_module(module: Any, input_route: str = "out") -> Edit:
    """Replace the site's value with `module(value)` (a black-box forward splice)."""
    if input_route not in ("out", "in"):
        raise InterventionError("intervention_edit_invalid", f"input_route={input_route!r} is not 'out' or 'in'",
                                remedy="splice_module(module, input_route='out')")
    if not callable(module):
        raise InterventionError("intervention_edit_invalid", "splice_module needs a callable module",
                                remedy="pass an nn.Module or function")
    return Edit("splice_module", (("module", type(module).__name__), ("input_route", input_route)),
                lambda v, ctx: module(v), portability="session", signal="forward", allow_shape_change=True)


def positions(edit: Any, positions: Any, *, mask: Any = None, assume_no_padding: bool = False, axis: int = 1) -> Edit:
    """Restrict a same-shape edit to chosen token positions of a (batch, tokens, ...) value."""
    inner = as_edit(edit)
    pos = tuple(positions) if isinstance(positions, (list, tuple, range)) else (int(positions),)

    def fn(v: Any, ctx: HookContext) -> Any:
        new = inner(v, ctx)
        n = v.shape[axis]
        picked = [p % n for p in pos]
        keep = [i for i in range(n) if i not in picked]
        if not keep:
            return new
        moved_new, moved_old = ctx.ops.moveaxis(new, axis, 0), ctx.ops.moveaxis(v, axis, 0)
        sel = ctx.ops.asarray([[i in picked] for i in range(n)], None)
        sel = sel.reshape((n,) + (1,) * (len(v.shape) - 1))
        return ctx.ops.moveaxis(ctx.ops.where(sel, moved_new, moved_old), 0, axis)

    return Edit("positions", (("edit", inner.identity()), ("positions", pos), ("axis", axis)), fn,
                portability=inner.portability, signal=inner.signal, tensors=inner.tensors)


def keep_grad(edit: Any) -> Edit:
    """The same forward edit, checked at fire time to keep the autograd graph."""
    inner = as_edit(edit)

    def fn(v: Any, ctx: HookContext) -> Any:
        out = inner(v, ctx)
        if getattr(v, "requires_grad", False) and not getattr(out, "requires_grad", True):
            from torchlens.errors import InvalidArgumentError

            raise InvalidArgumentError("edit_detached_from_graph", f"{inner.name} at {ctx.label} wrote values with no graph",
                                       remedy="use a graph-keeping form, e.g. keep_grad(tl.scale(0.0))", label=ctx.label,
                                       reason="edit_detached")
        return out

    return Edit(inner.name, inner.kwargs + (("keep_grad", True),), fn, portability="opaque_audit", signal=inner.signal,
                tensors=inner.tensors, allow_shape_change=inner.allow_shape_change)


def stamp_tensors(edit: Edit) -> None:
    """Record a content digest of each tensor an edit holds (at staging time)."""
    if edit.tensors and "_digests" not in edit.__dict__:
        object.__setattr__(edit, "_digests", tuple(tensor_digest(t) for t in edit.tensors))


def check_tensors_unchanged(edit: Edit) -> None:
    """Refuse when a tensor the edit holds changed after it was staged."""
    staged = edit.__dict__.get("_digests")
    if staged is None:
        return
    for t, d in zip(edit.tensors, staged):
        if tensor_digest(t) != d:
            raise InterventionError("helper_tensor_changed_since_capture",
                                    f"a tensor held by {edit.name} changed after the edit was staged",
                                    remedy="re-stage the edit (trace.clear_edits(site) then trace.do(...)) to use the new value")
