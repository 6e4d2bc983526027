"""The rules by which torch replay validation compares an op or excuses an insensitive parent.

Validation must fail only on a real capture defect, so where bit-equality or sensitivity
cannot hold for a reason the values themselves prove, a named rule says so and the decision
record carries the rule and why (the rule names are `tl.backends.VALIDATION_EXEMPTIONS`):

- how an op's replay is compared (`comparison`): bit for bit; by shape and dtype only for
  uninitialised memory (`empty_like`, `new_empty`, ...); within a dtype-derived tolerance for
  an op recorded inside a `torch.compile`d region (a compiled kernel and its eager replay
  round differently);
- why a parent that does not move the output under perturbation is still read
  (`implied_by_operand`): another operand pins the output (an all-zero factor, a constant
  bool mask, a saturating operand). The rule only holds when moving that operand makes the
  parent matter again, so an op whose callable truly ignores a parent still fails;
- discrete outputs (a float -> bool cast, a comparison): a step function of its input need
  not move under a perturbation (`discrete_output`), recorded with whether a probe moved it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: callables whose output is uninitialised memory: compared by shape and dtype only.
UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                           "empty_permuted"})

#: a compiled kernel vs its eager replay: allowed difference, in units of the dtype's epsilon
#: (relative, and absolute relative to the output's largest magnitude).
COMPILED_ULPS = 32


def same_bits(a: Any, b: Any) -> bool:
    """Equal shape, dtype and bits (NaN equal to NaN)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b) or ((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def same_meta(a: Any, b: Any) -> bool:
    """Equal shape and dtype (for uninitialised memory)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype


def tolerance_for(dtype: torch.dtype, want: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for a compiled-vs-eager comparison: COMPILED_ULPS epsilons of `dtype`,
    the absolute part scaled by the output's largest finite magnitude."""
    eps = torch.finfo(dtype).eps if (dtype.is_floating_point or dtype.is_complex) else 0.0
    if dtype.is_complex:
        eps = torch.finfo(torch.float32 if dtype == torch.complex64 else torch.float64).eps
    finite = want.detach()[torch.isfinite(want.detach())] if want.numel() else want.detach()
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return COMPILED_ULPS * eps, COMPILED_ULPS * eps * scale


def close(a: Any, b: Any) -> bool:
    """Within the dtype-derived tolerance (bits for integer and bool outputs)."""
    if not same_meta(a, b):
        return False
    if not isinstance(a, torch.Tensor) or not (b.is_floating_point() or b.is_complex()):
        return same_bits(a, b)
    rtol, atol = tolerance_for(b.dtype, b)
    return bool(torch.allclose(a.detach(), b.detach(), rtol=rtol, atol=atol, equal_nan=True))


def compiled_region(trace: Any, op: Any) -> str | None:
    """The `torch.compile`d region an op was recorded in: the address of an enclosing
    `OptimizedModule`, or `meta["compiled"]` when the capture marked the op itself."""
    mark = op.meta.get("compiled")
    if mark:
        return str(mark) if isinstance(mark, str) else "a compiled function"
    modules = getattr(trace, "modules", None)
    for addr in getattr(op, "modules", None) or ():
        try:
            m = modules[addr] if modules is not None and addr in modules else None
        except Exception:
            m = None
        if m is not None and getattr(m, "class_name", None) == "OptimizedModule":
            return addr
    return None


def comparison(trace: Any, op: Any) -> tuple[str, Callable[[Any, Any], bool], dict[str, Any]]:
    """How `op`'s replay is compared with its saved output: (mode, compare, record fields)."""
    if op.func_name in UNINITIALISED:
        return "shape_dtype", same_meta, {
            "why": f"{op.func_name} returns uninitialised memory: its bits are whatever the allocator held, so "
                   "only its shape and dtype are compared"}
    region = compiled_region(trace, op)
    if region is not None:
        dtypes = sorted({str(d) for d in (op.dtypes or ()) if d})
        return "tolerance", close, {
            "ulps": COMPILED_ULPS, "region": region,
            "why": f"recorded inside the torch.compile'd region {region!r}: a compiled kernel and its eager replay "
                   f"round differently, so outputs are compared within {COMPILED_ULPS} epsilons of their dtype "
                   f"({', '.join(dtypes) or 'float'}), relative and scaled by the output's largest magnitude"}
    return "bits", same_bits, {}


def is_discrete(outs: tuple) -> bool:
    """Every output is a bool or integer tensor (a step function of float inputs)."""
    ts = [o for o in outs if isinstance(o, torch.Tensor)]
    return bool(ts) and all(not (o.is_floating_point() or o.is_complex()) for o in ts)


def probes(v: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Values a discrete output's parent is probed with after random perturbations: the
    points where casts and comparisons change (zero, the other sign, infinities)."""
    d = v.detach()
    out = [("zeros", torch.zeros_like(d)), ("negated", -d)]
    if d.is_floating_point():
        out += [("+inf", torch.full_like(d, float("inf"))), ("-inf", torch.full_like(d, float("-inf")))]
    return out


def moved_operand(w: torch.Tensor, k: int) -> torch.Tensor | None:
    """Another operand moved to a generic point: a float one perturbed (a zero one gets
    nonzero values), a bool one flipped; None for integer operands (indices)."""
    d = w.detach()
    if d.dtype == torch.bool:
        return ~d
    if d.is_floating_point() or d.is_complex():
        g = torch.Generator(device=d.device).manual_seed(4321 + k)
        scale = float(d.abs().max()) + 1.0 if d.numel() else 1.0
        return (d + torch.randn(d.shape, generator=g, dtype=d.dtype, device=d.device) * scale).to(d.dtype)
    return None


def operand_rule(w: torch.Tensor) -> tuple[str, str]:
    """The rule an implying operand's value names: (rule, why fragment)."""
    d = w.detach()
    if d.dtype == torch.bool:
        if d.numel() and (bool(d.all()) or not bool(d.any())):
            return "constant_mask", f"is a constant mask (all {bool(d.flatten()[0])})"
        return "constant_mask", "is a mask that selects none of the perturbed elements"
    if (d.is_floating_point() or d.is_complex()) and d.numel() and not bool(d.any()):
        return "zero_factor", "is all zero"
    return "saturating_operand", "holds the op where the perturbed parent cannot move it"


#: functional writes into a view of a receiver (how writes through views are recorded).
_SCATTERS = frozenset({"as_strided_scatter", "slice_scatter", "select_scatter", "diagonal_scatter"})


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _arg(op: Any, pos: int, name: str, default: Any = None) -> Any:
    """A literal argument of `op` by position or keyword, from its argument template."""
    t, kw = op.args_template or (), op.kwargs_template or {}
    return t[pos] if len(t) > pos else kw.get(name, default)


def structural_rule(op: Any, pos: int, shapes: list[tuple[int, ...] | None]) -> tuple[str, str] | None:
    """A shape that makes the output constant in its positional argument `pos` (`shapes`:
    each positional argument's shape): (rule, why), or None.

    - attention over a single key (`scaled_dot_product_attention` with key length 1): the
      softmax weight is 1 whatever the query and key, so the output is the value;
    - a softmax over an axis of size 1 is 1 (`log_softmax`: 0) whatever its input;
    - a `*_scatter` whose source has as many elements as its receiver overwrites all of it.
    """
    name = op.func_name
    if name in _SCATTERS and pos == 0 and len(shapes) > 1 and shapes[0] is not None and shapes[1] is not None \
            and _numel(shapes[1]) == _numel(shapes[0]):
        return "overwritten_receiver", (f"{name} writes a source with as many elements as its receiver: every "
                                        "element of the receiver is overwritten")
    if name == "scaled_dot_product_attention" and pos in (0, 1) and len(shapes) > 1 and shapes[1] \
            and len(shapes[1]) >= 2 and shapes[1][-2] == 1:
        return "single_key_attention", ("the attention has a single key, so its softmax weight is 1 whatever the "
                                        "query and key: the output is the value")
    if name in ("softmax", "log_softmax", "_softmax", "_log_softmax") and pos == 0 and shapes and shapes[0]:
        dim = _arg(op, 1, "dim")
        if isinstance(dim, int) and -len(shapes[0]) <= dim < len(shapes[0]) and shapes[0][dim] == 1:
            return "size_one_softmax", f"a {name} over an axis of size 1 is constant whatever its input"
    return None


#: clamp-like callables and where their literal bounds sit: name -> (lower, upper) as
#: (position, keyword, default) triples (None: no such bound).
_CLAMPS: dict[str, tuple[Any, Any]] = {
    "clamp": ((1, "min", None), (2, "max", None)), "clamp_": ((1, "min", None), (2, "max", None)),
    "clip": ((1, "min", None), (2, "max", None)), "clip_": ((1, "min", None), (2, "max", None)),
    "clamp_min": ((1, "min", None), None), "clamp_min_": ((1, "min", None), None),
    "clamp_max": (None, (1, "max", None)), "clamp_max_": (None, (1, "max", None)),
    "hardtanh": ((1, "min_val", -1.0), (2, "max_val", 1.0)), "hardtanh_": ((1, "min_val", -1.0), (2, "max_val", 1.0)),
    "relu": ((None, None, 0.0), None), "relu_": ((None, None, 0.0), None),
    "relu6": ((None, None, 0.0), (None, None, 6.0)),
}


def _bound(op: Any, spec: Any) -> float | None:
    if spec is None:
        return None
    pos, name, default = spec
    value = default if pos is None else _arg(op, pos, name, default)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def saturation_probe(op: Any, v: torch.Tensor, got: tuple) -> tuple[torch.Tensor, str] | None:
    """For a clamp-like op with literal bounds whose every output element sits on a bound
    (its input saturated: Mask R-CNN's level mapper clamps every small box to the lowest
    level), a probe input strictly inside the bounds, and why the parent cannot move the op.
    The rule holds only if the op does move when fed the probe (checked by the caller), so a
    callable that ignores its input still fails. None when the op is not such a clamp."""
    spec = _CLAMPS.get(op.func_name)
    out = got[0] if got else None
    if spec is None or not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
        return None
    lo, hi = _bound(op, spec[0]), _bound(op, spec[1])
    if lo is None and hi is None:
        return None
    o = out.detach()
    on_lo = (o == lo) if lo is not None else torch.zeros_like(o, dtype=torch.bool)
    on_hi = (o == hi) if hi is not None else torch.zeros_like(o, dtype=torch.bool)
    if not bool((on_lo | on_hi).all()):
        return None
    if lo is not None and hi is not None:
        inside = (lo + hi) / 2.0 if hi > lo else None
    else:
        inside = lo + 1.0 if lo is not None else hi - 1.0
    if inside is None:
        return None
    bounds = ", ".join(f"{n}={b:g}" for n, b in (("min", lo), ("max", hi)) if b is not None)
    return (torch.full_like(v.detach(), inside),
            f"every element of its input lies beyond a literal bound ({bounds}), so the output is that bound "
            "whatever a small perturbation does")
