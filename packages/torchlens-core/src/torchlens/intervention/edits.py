"""Edits: what an intervention does to the value at a site.

An `Edit` is a frozen description (name, arguments) plus the function that applies it. The
math runs through the backend's edit ops (`backend.edit_ops()`: `zeros_like`, `clip`,
`mean`, `norm`, `randn_like`, `moveaxis`, `asarray`, `clone`, `permute_flat`), so the
same helper works on torch tensors, JAX arrays and numpy arrays alike, and core imports no
framework. A helper's tensor arguments are read on the host (checks, digests) through the
owning backend's `host_copy` (`checks.to_numpy`), never through a framework's own methods.

Each helper checks its arguments when it is built and carries a `check(site_shape)` run at
staging (`checks.py`). Every engine applies an edit through `fire`, which hands user code (a
hook, a spliced module, a hand-built Edit) its own copy of the value, so no edit can write
into a payload another trace holds or into the model's weights or inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from torchlens.errors import AmbiguousAxisError, InterventionError
from torchlens.intervention import checks as C


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
    state (patch_from, mean_ablate, splice_module). `check(site_shape)` refuses a site the
    edit does not fit (run at staging against the recorded shape, and again at fire time).
    `trusted` is True only for edits built by TorchLens' own helpers from TorchLens code:
    every other edit (a hook, a spliced module, a hand-built Edit) gets its own copy of the
    value, so it can never write into a payload another trace holds.
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...]
    fn: Callable[[Any, HookContext], Any]
    portability: str = "builtin"
    signal: str | None = None
    allow_shape_change: bool = False
    tensors: tuple[Any, ...] = ()
    check: Callable[[tuple], None] | None = None

    def __call__(self, value: Any, ctx: HookContext) -> Any:
        if self.check is not None and hasattr(value, "shape"):
            self.check(tuple(value.shape))
        return self.fn(value, ctx)

    @property
    def trusted(self) -> bool:
        return bool(self.__dict__.get("_trusted", False))

    @property
    def audit_extra(self) -> dict[str, Any]:
        """Facts this edit adds to its audit (fire) record, e.g. `stochastic=False` for a
        Population mean."""
        return dict(self.__dict__.get("_audit_extra", {}))

    def check_site(self, shape: Any) -> None:
        """Refuse a site of this recorded shape before anything is mutated (staging)."""
        if self.check is not None and shape is not None:
            self.check(tuple(shape))

    def identity(self) -> str:
        """A stable text identity (used by Recipe.digest and duplicate checks)."""
        parts = [self.name]
        for k, v in self.kwargs:
            parts.append(f"{k}={_value_identity(v)}")
        return "(".join([parts[0], ", ".join(parts[1:])]) + ")"

    def __repr__(self) -> str:
        return f"tl.{self.identity()}"


def _builtin(edit: Edit, trusted: bool = True) -> Edit:
    """Mark an edit built here, from TorchLens code only, as trusted not to write into its input."""
    if trusted:
        object.__setattr__(edit, "_trusted", True)
    return edit


def fire(edit: Edit, value: Any, ctx: HookContext) -> Any:
    """Apply `edit` to `value` on any engine. An untrusted edit (user code) is handed a copy
    it may mutate (copy-on-write), never the payload, parameter or input the value aliases."""
    if not edit.trusted and hasattr(value, "shape"):
        value = ctx.ops.clone(value)
    return edit(value, ctx)


def _both(*checks: Any) -> Callable[[tuple], None] | None:
    present = [c for c in checks if c is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def run(shape: tuple) -> None:
        for c in present:
            c(shape)

    return run


def _value_identity(v: Any) -> str:
    if isinstance(v, (int, float, str, bool, type(None))):
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(_value_identity(x) for x in v) + ")"
    if isinstance(v, Population):
        return v.identity()
    shape = getattr(v, "shape", None)
    if shape is not None:
        return f"<tensor {tuple(shape)} sha256:{tensor_digest(v)[:16]}>"
    return f"<{type(v).__name__}>"


def tensor_digest(v: Any) -> str:
    """sha256 of a tensor's content (read on the host by its backend, without importing a framework)."""
    import numpy as np

    arr = C.to_numpy(v)
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


def _vector_check(who: str, n: int, dim: int | None) -> Callable[[tuple], None]:
    """A 1-d direction of length `n` must lie along `dim` (or one inferred axis) of the site."""
    remedy = f"pass a direction as long as the site's axis dim, or dim= naming an axis of length {n}"

    def check(site: tuple) -> None:
        if dim is None:
            matches = [i for i, s in enumerate(site) if s == n]
            if not matches and who == "steer":  # dim= cannot help: no axis has this length; say which fit
                lengths = sorted({int(s) for s in site})
                raise C.bad(who, f"a direction of length {n} fits no axis of the site's shape {site}; expected a "
                            f"length of {site[-1] if site else '?'} (the last axis) or another axis length {lengths}",
                            f"pass a direction of length {site[-1] if site else '?'} for the site's last axis "
                            f"(check trace[site].shape)", "steer_direction_invalid", length=n,
                            expected_lengths=lengths, site_shape=site)
            if len(matches) != 1:
                raise AmbiguousAxisError("axis_ambiguous", f"{who}: a direction of length {n} matches axes {matches} of "
                                         f"shape {site}", remedy=f"pass dim= (one of {matches or list(range(len(site)))})",
                                         matching_dims=matches, shape=site)
            return
        axis = C.axis_in(who, dim, site, "steer_direction_invalid", remedy)
        if site[axis] != n:
            raise C.bad(who, f"a direction of length {n} does not fit axis {dim} of the site's shape {site} "
                        f"(length {site[axis]})", remedy, "steer_direction_invalid", length=n, dim=dim, site_shape=site)

    return check


def _allow(who: str, allow_shape_change: Any) -> bool:
    return C.flag(who, "allow_shape_change", allow_shape_change)


def _scalar_value(v: Any) -> Any:
    """A Python number to compute with (numpy scalars as float/int; tensors unchanged)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return v


# helpers ---------------------------------------------------------------------------------

def zero_ablate(*, allow_shape_change: bool = False) -> Edit:
    """Set the site to zeros."""
    _allow("zero_ablate", allow_shape_change)
    return _builtin(Edit("zero_ablate", (), lambda v, ctx: ctx.ops.zeros_like(v), allow_shape_change=allow_shape_change))


def scale(factor: float, *, allow_shape_change: bool = False) -> Edit:
    """Multiply the site by `factor` (a finite real number)."""
    C.real("scale", "factor", factor, remedy="tl.scale(0.5): a finite int or float")
    _allow("scale", allow_shape_change)
    f = _scalar_value(factor)
    return _builtin(Edit("scale", (("factor", factor),), lambda v, ctx: v * f, allow_shape_change=allow_shape_change))


def add(value: Any, *, allow_shape_change: bool = False) -> Edit:
    """Add a finite scalar or a finite tensor that broadcasts to the site."""
    _allow("add", allow_shape_change)
    remedy = "tl.add(1.0) or tl.add(t) with a finite tensor that broadcasts to the site"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        C.real("add", "value", value, remedy=remedy)
        v0 = _scalar_value(value)
        return _builtin(Edit("add", (("value", value),), lambda v, ctx: v + v0, allow_shape_change=allow_shape_change))
    shape = C.tensor("add", "value", value, remedy=remedy)
    check = None if allow_shape_change else (lambda site: C.broadcast_into("add", "value", shape, site, False))
    return _builtin(Edit("add", (("value", value),), lambda v, ctx: v + ctx.ops.asarray(value, v), tensors=(value,),
                         allow_shape_change=allow_shape_change, check=check))


def clamp(min: float | None = None, max: float | None = None, *, allow_shape_change: bool = False) -> Edit:  # noqa: A002
    """Clip the site to [min, max]."""
    if min is None and max is None:
        raise InterventionError("intervention_edit_invalid", "clamp needs min= or max=", remedy="tl.clamp(min=0.0)")
    remedy = "tl.clamp(min=-1.0, max=1.0): finite numbers with min <= max"
    for name, bound in (("min", min), ("max", max)):
        if bound is not None:
            C.real("clamp", name, bound, remedy=remedy)
    if min is not None and max is not None and float(min) > float(max):
        raise C.bad("clamp", f"min={min!r} is above max={max!r}", remedy)
    _allow("clamp", allow_shape_change)
    lo = None if min is None else _scalar_value(min)
    hi = None if max is None else _scalar_value(max)
    return _builtin(Edit("clamp", (("min", min), ("max", max)), lambda v, ctx: ctx.ops.clip(v, lo, hi),
                         allow_shape_change=allow_shape_change))


def add_noise(std: float = 1.0, *, seed: int = 0, allow_shape_change: bool = False) -> Edit:
    """Add Gaussian noise with standard deviation `std`, drawn from its own seeded stream."""
    C.real("add_noise", "std", std, low=0.0, remedy="tl.add_noise(0.1, seed=0): a finite std >= 0")
    C.integer("add_noise", "seed", seed, low=0, high=2**63 - 1, remedy="seed= a non-negative int")
    _allow("add_noise", allow_shape_change)
    s = _scalar_value(std)
    return _builtin(Edit("add_noise", (("std", std), ("seed", seed)), lambda v, ctx: v + ctx.ops.randn_like(v, seed) * s,
                         allow_shape_change=allow_shape_change))


_SEMANTIC_AXES = ("batch", "position", "feature")


class Population:
    """`tl.intervention.Population(members)`: values averaged elementwise by
    `mean_ablate(population, dim=...)`. `members` is a non-empty sequence of same-shaped
    finite tensors (or Op-likes, whose `.out` is read when the edit fires).

    `mean_ablate(pop, dim="members")` fills the site with the member-shaped mean
    (sum of the members / their count); `dim=None` reduces that mean to one scalar, and
    axes reduce it with keepdim. A population is never drawn from: the audit row says
    `stochastic=False`, and the spec holding it is `opaque_audit` (it saves at level
    "audit" only)."""

    __slots__ = ("_members", "_shape")

    def __init__(self, members: Any) -> None:
        remedy = "tl.intervention.Population([t1, t2, ...]) with same-shaped finite tensors (or Ops)"
        if isinstance(members, (str, bytes, dict)) or C.is_tensor_like(members) or not hasattr(members, "__iter__"):
            raise C.bad("Population", f"members={type(members).__name__} is not a sequence of tensors", remedy,
                        "intervention_edit_invalid", argument="members")
        items = tuple(members)
        if not items:
            raise C.bad("Population", "a population needs at least one member", remedy, "intervention_edit_invalid",
                        argument="members")
        shapes = []
        for i, m in enumerate(items):
            if _op_like(m):
                shape = getattr(m, "shape", None)
                shapes.append(tuple(shape) if shape is not None else None)
            else:
                shapes.append(C.tensor("Population", f"members[{i}]", m, remedy=remedy))
        known = {s for s in shapes if s is not None}
        if len(known) > 1:
            raise C.bad("Population", f"the members have different shapes {sorted(known)}; they are averaged elementwise",
                        remedy, "edit_argument_shape_mismatch", shapes=sorted(known))
        self._members = items
        self._shape = next(iter(known)) if known else None

    @property
    def members(self) -> tuple[Any, ...]:
        return self._members

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The members' shape (None when every member is an Op-like of unknown shape)."""
        return self._shape

    def __len__(self) -> int:
        return len(self._members)

    def tensors(self) -> tuple[Any, ...]:
        return tuple(m for m in self._members if not _op_like(m))

    def identity(self) -> str:
        parts = []
        for m in self._members:
            if _op_like(m):
                parts.append(f"op:{getattr(m, 'label', type(m).__name__)}")
            else:
                parts.append(tensor_digest(m)[:16])
        return f"<Population n={len(parts)} shape={self._shape} {hashlib.sha256(' '.join(parts).encode()).hexdigest()[:16]}>"

    def mean(self, like: Any, ops: Any) -> Any:
        """The elementwise mean of the members, as the site's framework and dtype."""
        acc = None
        for m in self._members:
            v = ops.asarray(m.out if _op_like(m) else m, like)
            acc = v if acc is None else acc + v
        return acc * (1.0 / len(self._members))

    def __repr__(self) -> str:
        return f"tl.intervention.Population({len(self._members)} members of shape {self._shape})"


def _op_like(m: Any) -> bool:
    """An Op or Layer record (read through `.out` when the edit fires), not a tensor."""
    return hasattr(m, "label") and hasattr(m, "out") and hasattr(m, "kind")


def _mean_dims(dim: Any, members_ok: bool = False) -> tuple[int, ...] | str | None:
    if dim is None:
        return None
    if isinstance(dim, str) and dim == "members":
        if not members_ok:
            raise InterventionError("intervention_over_invalid", "mean_ablate(dim='members') averages over a Population's "
                                    "members; this source is not a tl.intervention.Population",
                                    remedy="mean_ablate(tl.intervention.Population([t1, t2, ...]), dim='members'), or an "
                                    "axis number for a tensor or the site", dim=repr(dim))
        return "members"
    if isinstance(dim, str) and dim in _SEMANTIC_AXES:
        raise InterventionError("axis_semantics_unknown", f"mean_ablate(dim={dim!r}) names an axis role TorchLens has no "
                                "evidence for", remedy="pass the axis number, e.g. mean_ablate(dim=0) for the batch axis",
                                dim=dim)
    ok = isinstance(dim, numbers.Integral) and not isinstance(dim, bool)
    ok = ok or (isinstance(dim, tuple) and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dim))
    if not ok:
        raise InterventionError("intervention_over_invalid", f"mean_ablate(dim={dim!r}) is not None, an int, a tuple of "
                                "ints or 'members'", remedy="mean_ablate(dim=0) averages over the batch axis",
                                dim=repr(dim))
    dims = (int(dim),) if not isinstance(dim, tuple) else tuple(int(d) for d in dim)
    if len(set(dims)) != len(dims):
        raise InterventionError("intervention_over_invalid", f"mean_ablate(dim={dim!r}) names an axis twice",
                                remedy="name each axis once", dim=repr(dim))
    return dims


def mean_ablate(source: Any = None, *, dim: Any, allow_shape_change: bool = False) -> Edit:
    """Fill the site with a mean over `dim` (None: every axis) of `source` (default: the site).
    A `Population` source is averaged over its members first (`dim="members"` keeps that
    member-shaped mean)."""
    population = source if isinstance(source, Population) else None
    dims = _mean_dims(dim, members_ok=population is not None)
    _allow("mean_ablate", allow_shape_change)
    src_shape: tuple | None = None
    if population is not None:
        src_shape = population.shape
    elif source is not None and not hasattr(source, "out"):
        src_shape = C.tensor("mean_ablate", "source", source,
                             remedy="pass a finite tensor, an Op (its .out), a tl.intervention.Population, or no source "
                             "(the site's own value)")
    elif source is not None:
        src_shape = tuple(getattr(source, "shape", None) or ()) or None

    def check(site: tuple) -> None:
        shape = site if source is None else src_shape
        if shape is None:
            return
        if dims == "members":
            reduced = tuple(shape)
        elif dims is not None:
            for d in dims:
                if not -len(shape) <= d < len(shape):
                    raise InterventionError("intervention_over_invalid", f"mean_ablate(dim={dim!r}): axis {d} is not an "
                                            f"axis of the {'site' if source is None else 'source'} (shape {shape})",
                                            remedy=f"pick axes in range({len(shape)}) (or negative from the end)",
                                            dim=repr(dim), shape=shape)
            reduced = tuple(1 if (i in {d % len(shape) for d in dims}) else n for i, n in enumerate(shape))
        else:
            reduced = ()
        C.broadcast_into("mean_ablate", "the mean of source", reduced, site, allow_shape_change)

    def fn(v, ctx):
        if population is not None:
            src = population.mean(v, ctx.ops)
            m = src if dims == "members" else ctx.ops.mean(src, dim, True)
        else:
            src = v if source is None else _source_value(source, ctx)
            m = ctx.ops.mean(src, dim, True)
        return ctx.ops.zeros_like(v) + m

    if population is not None:
        tensors = population.tensors()
    else:
        tensors = () if source is None or not hasattr(source, "shape") else (source,)
    edit = _builtin(Edit("mean_ablate", (("source", source), ("dim", dim)), fn, signal="forward", tensors=tensors,
                         allow_shape_change=allow_shape_change, check=check,
                         portability="opaque_audit" if population is not None else "builtin"))
    if population is not None:
        object.__setattr__(edit, "_audit_extra", {"stochastic": False})
    return edit


def replace_with(value: Any, *, allow_shape_change: bool = False) -> Edit:
    """Set the site to a fixed value (a finite tensor of the site's shape, or a finite scalar)."""
    _allow("replace_with", allow_shape_change)
    remedy = "tl.replace_with(t) with a finite tensor of the site's shape, or a finite number"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        C.real("replace_with", "value", value, remedy=remedy)
        v0 = _scalar_value(value)
        return _builtin(Edit("replace_with", (("value", value),), lambda v, ctx: ctx.ops.zeros_like(v) + v0,
                             allow_shape_change=allow_shape_change))
    shape = C.tensor("replace_with", "value", value, remedy=remedy)

    def check(site: tuple) -> None:
        if shape != tuple(site) and not allow_shape_change:
            raise InterventionError("intervention_shape_changed", f"replace_with: a value of shape {shape} would change the "
                                    f"site from {tuple(site)}", remedy="pass a value of the site's shape, or "
                                    "allow_shape_change=True if that is intended", shape=shape, site_shape=tuple(site))

    return _builtin(Edit("replace_with", (("value", value),), lambda v, ctx: ctx.ops.clone(ctx.ops.asarray(value, v)),
                         tensors=(value,), allow_shape_change=allow_shape_change, check=check))


def _dim(who: str, dim: Any) -> int | None:
    if dim is None:
        return None
    return C.integer(who, "dim", dim, remedy="dim= an int axis of the site (or None to infer it)")


def steer(direction: Any, strength: float = 1.0, *, dim: int | None = None, allow_shape_change: bool = False) -> Edit:
    """Add `strength * direction` along axis `dim` (inferred when exactly one axis fits)."""
    shape = C.direction("steer", direction, vector=False, nonzero=False)
    C.real("steer", "strength", strength, remedy="tl.steer(v, 4.0): a finite strength")
    d_axis = _dim("steer", dim)
    _allow("steer", allow_shape_change)
    if len(shape) != 1 and d_axis is not None:
        raise C.bad("steer", f"dim= places a 1-d direction; this direction has shape {shape}",
                    "drop dim= (a multi-axis direction broadcasts against the site) or pass a 1-d direction",
                    "steer_direction_invalid", shape=shape)
    if len(shape) == 1:
        check = _vector_check("steer", shape[0], d_axis)
    else:
        def check(site: tuple) -> None:
            C.broadcast_into("steer", "direction", shape, site, allow_shape_change, code="steer_direction_invalid")
    k = _scalar_value(strength)

    def fn(v, ctx):
        d = ctx.ops.asarray(direction, v)
        axis = _axis(v, int(d.shape[-1]), d_axis, "steer") if len(d.shape) == 1 else None
        if axis is None:
            return v + d * k
        moved = ctx.ops.moveaxis(v, axis, -1)
        return ctx.ops.moveaxis(moved + d * k, -1, axis)

    return _builtin(Edit("steer", (("direction", direction), ("strength", strength), ("dim", dim)), fn, tensors=(direction,),
                         allow_shape_change=allow_shape_change, check=check))


def _projection(direction: Any, dim: int | None, keep: bool, name: str) -> Edit:
    shape = C.direction(name, direction, vector=True, nonzero=True)
    d_axis = _dim(name, dim)

    def fn(v, ctx):
        d = ctx.ops.asarray(direction, v)
        u = d / ctx.ops.norm(d, None, False)
        axis = _axis(v, int(d.shape[0]), d_axis, name)
        moved = ctx.ops.moveaxis(v, axis, -1)
        coeff = moved @ u
        along = coeff[..., None] * u
        out = along if keep else moved - along
        return ctx.ops.moveaxis(out, -1, axis)

    return _builtin(Edit(name, (("direction", direction), ("dim", dim)), fn, tensors=(direction,),
                         check=_vector_check(name, shape[0], d_axis)))


def project_onto(direction: Any, *, dim: int | None = None) -> Edit:
    """Keep only the component along `direction` (finite, 1-d, non-zero)."""
    return _projection(direction, dim, True, "project_onto")


def project_out(direction: Any, *, dim: int | None = None) -> Edit:
    """Remove the component along `direction` (finite, 1-d, non-zero)."""
    return _projection(direction, dim, False, "project_out")


def clip_norm(max_norm: float, norm_type: float = 2.0) -> Edit:
    """Rescale the whole tensor so its `norm_type` norm is at most `max_norm`."""
    C.real("clip_norm", "max_norm", max_norm, low=0.0, remedy="tl.clip_norm(1.0): a finite max_norm >= 0")
    C.real("clip_norm", "norm_type", norm_type, low=0.0, low_open=True, allow_inf=True,
           remedy="norm_type= a number > 0 (2.0 by default, float('inf') for the max norm)")
    mx, p = _scalar_value(max_norm), _scalar_value(norm_type)

    def fn(v, ctx):
        n = ctx.ops.norm(v, None, False, p)
        factor = ctx.ops.clip(mx / (n + 1e-12), None, 1.0)
        return v * factor

    return _builtin(Edit("clip_norm", (("max_norm", max_norm), ("norm_type", norm_type)), fn))


def _is_trace_like(v: Any) -> bool:
    return hasattr(v, "ops") and hasattr(v, "find_sites")


def patch_from(source: Any, *, site: Any = None) -> Edit:
    """Replace the site with the value a donor trace recorded at the same label (or `site`)."""
    if not _is_trace_like(source):
        raise InterventionError("patch_source_invalid", f"patch_from needs a donor trace, not {type(source).__name__}",
                                remedy="tl.patch_from(donor_trace); for a fixed tensor use tl.replace_with(t)")
    from torchlens.select.selectors import Selector

    if not (site is None or isinstance(site, (str, Selector))):
        raise InterventionError("patch_source_invalid", f"patch_from(site=...) takes a label or selector, not "
                                f"{type(site).__name__}", remedy="site='relu_1_2' or site=tl.module('fc')")

    def fn(v, ctx):
        key = site if site is not None else ctx.label
        try:
            donor = source.ops[key] if isinstance(key, str) else source.find_sites(key).first()
        except KeyError as exc:
            raise InterventionError("patch_source_invalid", f"the donor trace has no op {key!r}",
                                    remedy="patch between traces of the same model, or pass site=") from exc
        return ctx.ops.clone(donor.out)

    return _builtin(Edit("patch_from", (("source", f"<trace {getattr(source, 'name', '?')}>"), ("site", repr(site))), fn,
                         signal="forward", portability="session"))


def swap_with(donor: Any) -> Edit:
    """Replace the site with a fixed donor tensor (portable), or a donor trace's value."""
    if _is_trace_like(donor):
        return patch_from(donor)
    return replace_with(donor)


def scramble_elements(seed: int = 0, *, source: Any = None) -> Edit:
    """Replace the site with a scramble of its own flattened elements (a seeded permutation),
    or, with `source=` (a finite tensor), with elements drawn iid (uniformly, with replacement)
    from the flattened source: element i of the site gets `flat(source)[idx[i]]`, idx drawn by
    `numpy.random.default_rng(seed).integers(0, source.size, site.size)`."""
    C.integer("scramble_elements", "seed", seed, low=0, high=2**63 - 1, remedy="seed= a non-negative int")
    if source is None:
        return _builtin(Edit("scramble_elements", (("seed", seed),), lambda v, ctx: ctx.ops.permute_flat(v, seed)))
    remedy = "scramble_elements(seed=0, source=t) with a finite tensor holding at least one element"
    shape = C.tensor("scramble_elements", "source", source, remedy=remedy)
    size = int(np.prod(shape)) if shape else 1
    if size == 0:
        raise C.bad("scramble_elements", "source= has no elements to draw from", remedy, argument="source")

    def fn(v: Any, ctx: HookContext) -> Any:
        n = int(np.prod(tuple(v.shape))) if tuple(v.shape) else 1
        idx = np.random.default_rng(int(seed)).integers(0, size, n)
        flat = ctx.ops.asarray(source, v).reshape(-1)
        return flat[ctx.ops.asarray(idx, None)].reshape(tuple(v.shape))

    return _builtin(Edit("scramble_elements", (("seed", seed), ("source", source)), fn, tensors=(source,)))


def hook(fn: Callable[..., Any]) -> Edit:
    """Wrap a hook callable `fn(value, *, ctx)`; it may return a new value or None (keep).
    It receives its own copy of the value, so an in-place write changes only the result."""
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


def _is_helper_factory(obj: Any) -> bool:
    """True for an edit helper itself (`tl.zero_ablate`, not `tl.zero_ablate()`): a function of
    torchlens.intervention declared to return an Edit. Passed as a hook it would fail only when
    the edit fires, with a raw TypeError, so it is refused when the edit is staged."""
    return (inspect.isfunction(obj) and str(getattr(obj, "__module__", "")).startswith("torchlens.intervention")
            and getattr(obj, "__annotations__", {}).get("return") in ("Edit", Edit))


def as_edit(obj: Any) -> Edit:
    """An Edit as-is; a callable as a hook; any other value as `replace_with(value)`."""
    if isinstance(obj, Edit):
        return obj
    if _is_helper_factory(obj):
        raise InterventionError("intervention_edit_invalid", f"tl.{obj.__name__} is an edit helper, not an edit: "
                                f"call it to build the edit", remedy=f"did you mean tl.{obj.__name__}()?",
                                helper=obj.__name__)
    if callable(obj):
        return hook(obj)
    if obj is None:
        raise InterventionError("intervention_edit_invalid", "None is not an edit",
                                remedy="pass a helper such as tl.zero_ablate(), a hook callable or a value")
    return replace_with(obj)


def splice_module(module: Any, input_route: str = "out") -> Edit:
    """Replace the site's value with `module(value)` (a black-box forward splice). The module
    gets its own copy of the value (an in-place module cannot write into a payload)."""
    if input_route not in ("out", "in"):
        raise InterventionError("intervention_edit_invalid", f"input_route={input_route!r} is not 'out' or 'in'",
                                remedy="splice_module(module, input_route='out')")
    if input_route == "in":
        raise C.bad("splice_module", "input_route='in' (feed the site's input) is not supported by this build",
                    "splice_module(module, input_route='out') feeds the site's own value")
    if not callable(module):
        raise InterventionError("intervention_edit_invalid", "splice_module needs a callable module",
                                remedy="pass an nn.Module or function")
    return Edit("splice_module", (("module", type(module).__name__), ("input_route", input_route)),
                lambda v, ctx: module(v), portability="session", signal="forward", allow_shape_change=True)


def _positions(pos: Any) -> Any:
    """A uniform form as a tuple of ints or a slice; "first"/"last" as text; a per-row
    (batch,) index tensor as a host int array."""
    remedy = ("pass an int, a list of ints, a slice, a (batch,) index tensor, or 'first' / 'last' with mask=, "
              "e.g. tl.positions(edit, [-1])")
    if isinstance(pos, numbers.Integral) and not isinstance(pos, bool):
        return (int(pos),)
    if isinstance(pos, (list, tuple, range)) and len(pos) > 0 and all(
            isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in pos):
        return tuple(int(p) for p in pos)
    if isinstance(pos, slice) and all(v is None or (isinstance(v, numbers.Integral) and not isinstance(v, bool))
                                      for v in (pos.start, pos.stop, pos.step)) and pos.step != 0:
        return pos
    if isinstance(pos, str) and pos in ("first", "last"):
        return pos
    if C.is_tensor_like(pos):
        arr = C.to_numpy(pos)
        if arr.ndim == 1 and arr.size and np.issubdtype(arr.dtype, np.integer):
            return arr.astype(np.int64)
    raise InterventionError("position_edit_invalid", f"positions={pos!r:.80} is not a supported form", remedy=remedy,
                            form=type(pos).__name__)


def _mask_rows(mask: Any, batch: int, n: int) -> np.ndarray:
    """The (batch, tokens) real-token mask as bool, or transform_mask_incompatible."""
    m = C.to_numpy(mask)
    if m.dtype != np.bool_:
        if not (np.issubdtype(m.dtype, np.integer) or np.issubdtype(m.dtype, np.floating)) or not np.all(np.isin(m, (0, 1))):
            raise InterventionError("transform_mask_incompatible", f"positions: the mask has dtype {m.dtype} with values "
                                    "other than 0/1", remedy="pass a (batch, tokens) attention mask of 0/1 or bool")
        m = m.astype(bool)
    if m.shape != (batch, n):
        raise InterventionError("transform_mask_incompatible", f"positions: the mask has shape {m.shape}; the value has "
                                f"{batch} rows of {n} tokens", remedy="pass the (batch, tokens) attention mask of this "
                                "input", mask_shape=tuple(m.shape), expected=(batch, n))
    empty = [i for i in range(batch) if not m[i].any()]
    if empty:
        raise InterventionError("transform_mask_incompatible", f"positions: rows {empty} of the mask have no real token",
                                remedy="every row needs at least one real token (mask True)", rows=empty)
    return m


def positions(edit: Any, positions: Any, *, mask: Any = None, assume_no_padding: bool = False, axis: int = 1) -> Edit:
    """Restrict a same-shape edit to chosen token positions of a (batch, tokens, ...) value:
    an int, a list of ints, a slice, a per-row (batch,) index tensor, or "first" / "last"
    (the first or last REAL token of each row, from mask= or assume_no_padding=True)."""
    inner = as_edit(edit)
    pos = _positions(positions)
    C.flag("positions", "assume_no_padding", assume_no_padding)
    ax = C.integer("positions", "axis", axis, remedy="axis= the token axis (an int)", code="position_edit_invalid")
    if isinstance(pos, str):
        if mask is None and not assume_no_padding:
            raise InterventionError("transform_mask_missing", f"positions={pos!r} picks the {pos} REAL token of each row, "
                                    "which needs the padding mask", remedy=f"tl.positions(edit, {pos!r}, mask=attention_mask)"
                                    ", or assume_no_padding=True when no row is padded", positions=pos)
        if mask is not None and assume_no_padding:
            raise InterventionError("position_edit_invalid", "mask= and assume_no_padding=True contradict each other",
                                    remedy="pass one of them")
        if mask is not None and not C.is_tensor_like(mask) and not isinstance(mask, list):
            raise InterventionError("transform_mask_incompatible", f"positions: mask={type(mask).__name__} is not an array",
                                    remedy="pass the (batch, tokens) attention mask")
    elif mask is not None:
        raise InterventionError("position_edit_invalid", "mask= only applies to positions='first' or 'last'",
                                remedy="drop mask= for explicit positions")
    per_row = isinstance(pos, str) or isinstance(pos, np.ndarray)
    if per_row and ax == 0:
        raise InterventionError("position_edit_invalid", "a per-row position form needs the token axis after the batch "
                                "axis", remedy="axis=1 (the default)")

    def rows(site: tuple) -> Any:
        """A bool (batch, n) selection for per-row forms, or the picked indices of axis `ax`."""
        a = C.axis_in("positions", ax, site, "position_edit_invalid", "axis= an axis of the site (the token axis)")
        n = site[a]
        if isinstance(pos, slice):
            return list(range(n))[pos]
        if isinstance(pos, tuple):
            out = [p for p in pos if not -n <= p < n]
            if out:
                raise InterventionError("position_edit_out_of_range", f"positions {out} are past a sequence of {n} tokens",
                                        remedy=f"positions in range(-{n}, {n})", positions=out, length=n)
            return [p % n for p in pos]
        batch = site[0]
        if isinstance(pos, np.ndarray):
            if pos.shape != (batch,):
                raise InterventionError("position_edit_invalid", f"a per-row index tensor has shape {pos.shape}; the value "
                                        f"has {batch} rows", remedy=f"pass a ({batch},) index tensor")
            bad = [int(p) for p in pos if not -n <= p < n]
            if bad:
                raise InterventionError("position_edit_out_of_range", f"positions {bad} are past a sequence of {n} tokens",
                                        remedy=f"positions in range(-{n}, {n})", positions=bad, length=n)
            idx = pos % n
        elif mask is None:  # assume_no_padding
            idx = np.full(batch, 0 if pos == "first" else n - 1)
        else:
            m = _mask_rows(mask, batch, n)
            idx = m.argmax(axis=1) if pos == "first" else n - 1 - m[:, ::-1].argmax(axis=1)
        sel = np.zeros((batch, n), dtype=bool)
        sel[np.arange(batch), idx] = True
        return sel

    def own_check(site: tuple) -> None:
        rows(site)

    def fn(v: Any, ctx: HookContext) -> Any:
        new = inner(v, ctx)
        shape = tuple(v.shape)
        a = ax % len(shape)
        n = shape[a]
        picked = rows(shape)
        if isinstance(picked, np.ndarray):  # per-row (batch, n): batch on axis 0, tokens on axis a
            dims = [1] * len(shape)
            dims[0], dims[a] = shape[0], n
            return ctx.ops.where(ctx.ops.asarray(picked.reshape(dims), None), new, v)
        if len(picked) == n:
            return new
        moved_new, moved_old = ctx.ops.moveaxis(new, a, 0), ctx.ops.moveaxis(v, a, 0)
        sel = ctx.ops.asarray([[i in picked] for i in range(n)], None)
        sel = sel.reshape((n,) + (1,) * (len(shape) - 1))
        return ctx.ops.moveaxis(ctx.ops.where(sel, moved_new, moved_old), 0, a)

    stored = pos if not isinstance(pos, np.ndarray) else tuple(int(p) for p in pos)
    if isinstance(stored, slice):
        stored = ("slice", stored.start, stored.stop, stored.step)
    return _builtin(Edit("positions", (("edit", inner.identity()), ("positions", stored), ("axis", axis)), fn,
                         portability=inner.portability, signal=inner.signal, tensors=inner.tensors,
                         check=_both(own_check, inner.check)), trusted=inner.trusted)


def compose(*edits: Any) -> Edit:
    """Apply `edits` one after another (each on the previous one's result), as one edit.
    keep_grad(compose(tl.scale(0.0), tl.add(v))) is the graph-keeping fixed value. It saves
    only at the audit level (its parts are not stored one by one) and has no subspace form."""
    if not edits:
        raise InterventionError("intervention_edit_invalid", "compose needs at least one edit",
                                remedy="tl.intervention.compose(tl.scale(0.0), tl.add(v))")
    parts = tuple(as_edit(e) for e in edits)
    for e in parts:
        if e.signal == "backward":
            raise InterventionError("intervention_edit_invalid", f"compose chains forward edits; {e.name} is a backward "
                                    "edit", remedy="stage the backward edit on tl.grad(site) on its own", edit=e.name)
    signal = "forward" if any(e.signal == "forward" for e in parts) else None
    trusted = all(e.trusted for e in parts)

    def fn(v: Any, ctx: HookContext) -> Any:
        for e in parts:
            v = fire(e, v, ctx)
        return v

    return _builtin(Edit("compose", (("edits", tuple(e.identity() for e in parts)),), fn, portability="session",
                         signal=signal, tensors=tuple(t for e in parts for t in e.tensors),
                         allow_shape_change=any(e.allow_shape_change for e in parts), check=parts[0].check), trusted=trusted)


def _is_rule_or_site(obj: Any) -> bool:
    """A Rule, Recipe or selector is not an edit (a gradient rule tl.when(tl.grad(s), e) least of all)."""
    from torchlens.intervention.recipe import Recipe, Rule
    from torchlens.select.selectors import Selector

    return isinstance(obj, (Rule, Recipe, Selector))


def keep_grad(edit: Any) -> Edit:
    """The same forward edit, checked at fire time to keep the autograd graph."""
    if not (isinstance(edit, Edit) or callable(edit)) or _is_rule_or_site(edit):
        raise InterventionError("keep_grad_edit_invalid", f"keep_grad wraps a forward edit or a hook callable, not "
                                f"{type(edit).__name__}", remedy="keep_grad(tl.scale(0.0)); stage it with "
                                "tl.when(site, keep_grad(edit))", given=type(edit).__name__)
    if isinstance(edit, Edit) and edit.signal == "backward":
        raise InterventionError("keep_grad_edit_invalid", f"keep_grad checks forward edits; {edit.name} is a backward edit",
                                remedy="apply the backward edit on tl.grad(site) without keep_grad", edit=edit.name)
    inner = as_edit(edit)

    def fn(v: Any, ctx: HookContext) -> Any:
        frontier = ctx.trace is not None and _DIFFERENTIABLE_REPLAY.get()
        if hasattr(v, "requires_grad") and not v.requires_grad and not frontier:
            # glossary l. 359: the site value itself carries no graph (a capture or call under no_grad, a value
            # no parameter reaches): nothing the edit writes can keep one. A differentiable replay's frontier
            # value may lack one; that case warns keep_grad_replay_frontier below instead.
            from torchlens.errors import InvalidArgumentError

            raise InvalidArgumentError("edit_detached_from_graph", f"keep_grad({inner.name}) at {ctx.label}: the site "
                                       "value carries no autograd graph (gradients disabled, e.g. under no_grad, or no "
                                       "parameter or grad-requiring input reaches it)", remedy="run with gradients "
                                       "enabled (no torch.no_grad(), no CaptureOptions(inference_only=True)), or edit a "
                                       "site the parameters reach", label=ctx.label, reason="site_has_no_graph")
        out = inner(v, ctx)
        if getattr(v, "requires_grad", False) and not getattr(out, "requires_grad", True):
            from torchlens.errors import InvalidArgumentError

            raise InvalidArgumentError("edit_detached_from_graph", f"{inner.name} at {ctx.label} wrote values with no graph",
                                       remedy="use a graph-keeping form, e.g. keep_grad(tl.scale(0.0))", label=ctx.label,
                                       reason="edit_detached")
        if ctx.trace is not None and _DIFFERENTIABLE_REPLAY.get() and getattr(v, "grad_fn", None) is None:
            # the check passed on a differentiable replay whose frontier value carries no autograd history
            # (a payload recorded without a graph): nothing upstream of it can get a gradient
            _warn_replay_frontier(inner.name, ctx.label)
        return out

    return _builtin(Edit(inner.name, inner.kwargs + (("keep_grad", True),), fn, portability="opaque_audit",
                         signal=inner.signal, tensors=inner.tensors, allow_shape_change=inner.allow_shape_change,
                         check=inner.check), trusted=inner.trusted)


#: True inside a differentiable replay (`do(..., intervention=InterventionOptions(differentiable=True))`)
_DIFFERENTIABLE_REPLAY: contextvars.ContextVar[bool] = contextvars.ContextVar("tl_differentiable_replay", default=False)
#: keep_grad_replay_frontier is said once per session (process)
_FRONTIER_WARNED = False


@contextlib.contextmanager
def differentiable_replay() -> Any:
    """Mark the replay run inside as differentiable (entered by `Trace.do` with
    `InterventionOptions(differentiable=True)`), so a keep_grad edit can say where its
    gradients stop."""
    token = _DIFFERENTIABLE_REPLAY.set(True)
    try:
        yield
    finally:
        _DIFFERENTIABLE_REPLAY.reset(token)


def _warn_replay_frontier(name: str, label: str) -> None:
    """glossary l. 361: once per session, a passing keep_grad check under differentiable replay
    warns keep_grad_replay_frontier: replay starts at the edited site, so the parameters upstream
    of it get no gradient from the replayed outputs."""
    global _FRONTIER_WARNED
    if _FRONTIER_WARNED:
        return
    _FRONTIER_WARNED = True
    import warnings

    from torchlens.errors import ReplayFrontierWarning

    warnings.warn(ReplayFrontierWarning(
        "keep_grad_replay_frontier", f"keep_grad({name}) at {label} kept the graph of the differentiable replay, which "
        f"starts at {label}: parameters upstream of the replay frontier get no gradient (said once per session)",
        remedy="for gradients to every parameter use the live path tl.when(site, keep_grad(edit)).bind(model)(x), or "
        "rerun with model= and inputs=", label=label, edit=name), stacklevel=2)


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
