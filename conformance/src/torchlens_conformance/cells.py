"""The conformance cells (spec: glossary § Backends, "Conformance case ids").

A cell takes a `Context` (the backend's spec, protocol object and zoo) and returns an
`Outcome`: passed, failed, or unsupported (a typed refusal from the backend). Cells are
generic: they use only `BackendProtocol` members, `tl.trace` and the backend's zoo, so a
third-party backend runs them unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import torchlens as tl
from torchlens.backends import (
    CAPABILITY_REFUSALS,
    REFUSAL_CODES,
    VALIDATION_REASONS,
    BackendCapabilities,
    BackendProtocol,
    BackendUnsupportedError,
    SupportsHostValues,
    missing_members,
    supports,
)
from torchlens.capture import OPTION_CAPABILITY, PUBLIC_TRACE_OPTIONS
from torchlens_conformance.zoo import REFERENCE_ULPS, ZooEntry, load_zoo, reference_tolerance


@dataclass(frozen=True)
class Outcome:
    outcome: str  # "passed" | "failed" | "unsupported"
    detail: str = ""


PASSED = Outcome("passed")


class CellFailure(AssertionError):
    pass


class CellUnsupported(Exception):
    """The backend declares False the capability a cell needs: `unsupported: <flag>`."""


def check(cond: bool, detail: str) -> None:
    if not cond:
        raise CellFailure(detail)


@dataclass
class Context:
    spec: Any
    proto: Any
    zoo: dict[str, ZooEntry]

    def trace(self, entry: ZooEntry, **kw: Any) -> Any:
        if entry.reseed is not None:
            entry.reseed()
        return tl.trace(entry.model, *entry.args, input_kwargs=entry.kwargs, backend=self.spec.name, **kw)

    def entries(self) -> list[ZooEntry]:
        """Every zoo entry; a backend that supplies no models fails the cell (a loop over an
        empty zoo must never pass)."""
        check(bool(self.zoo), "the backend supplies no models (BackendSpec.zoo is missing or empty)")
        return list(self.zoo.values())

    def first(self, prefer: str | None = None) -> ZooEntry:
        """The `prefer` role when the zoo has it, else its first entry (failing on an empty zoo)."""
        entries = self.entries()
        return (self.zoo.get(prefer) or entries[0]) if prefer else entries[0]

    def role(self, name: str) -> ZooEntry:
        self.entries()
        entry = self.zoo.get(name)
        check(entry is not None, f"the backend's zoo has no {name!r} model")
        return entry

    def host(self, value: Any) -> np.ndarray:
        return self.proto.host_copy(value)


def _leaves(ctx: Context, obj: Any) -> list[Any]:
    if ctx.proto.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(ctx, v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(ctx, v)]
    if hasattr(obj, "to_tuple"):
        return _leaves(ctx, obj.to_tuple())
    return []


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def _matches_reference(entry: ZooEntry, ref: np.ndarray, got: np.ndarray) -> bool:
    """Bit-equal, or, for an entry whose reference is a compiled kernel the capture evaluates
    step by step (`ZooEntry.compiled_reference`), equal within the dtype's tolerance."""
    if _same(ref, got):
        return True
    tol = reference_tolerance(ref.dtype) if entry.compiled_reference else None
    return (tol is not None and ref.shape == got.shape and ref.dtype == got.dtype
            and np.allclose(ref, got, rtol=tol[0], atol=tol[1], equal_nan=True))


# tier 0 ---------------------------------------------------------------------------------

def c0_protocol_complete(ctx: Context) -> Outcome:
    missing = missing_members(ctx.proto)
    check(not missing, f"missing members: {missing}")
    check(isinstance(ctx.proto, BackendProtocol), "not a BackendProtocol at runtime")
    check(ctx.proto.name == ctx.spec.name, f"protocol name {ctx.proto.name!r} != spec name {ctx.spec.name!r}")
    check(ctx.proto.maturity == ctx.spec.maturity, "protocol and spec maturity differ")
    check(ctx.proto.materialization in ("eager", "lazy"), "materialization is not eager or lazy")
    return PASSED


def c0_framework_requirement_consistent(ctx: Context) -> Outcome:
    fw = ctx.spec.framework
    check(fw == ctx.proto.framework, "spec and protocol framework requirements differ")
    check(bool(fw.distributions), "no framework distribution named")
    if fw.below is not None:
        check(fw.contains(fw.minimum), f"minimum {fw.minimum} is outside [{fw.minimum}, {fw.below})")
    if fw.pinned is not None:
        check(fw.contains(fw.pinned), f"pinned {fw.pinned} is outside {fw.range_text()}")
    if fw.tested_through is not None:
        check(fw.contains(fw.tested_through), f"tested_through {fw.tested_through} is outside {fw.range_text()}")
    return PASSED


def c0_refusal_codes_registered(ctx: Context) -> Outcome:
    declared = set(ctx.proto.refusal_codes())
    extra = declared - REFUSAL_CODES
    check(not extra, f"codes outside REFUSAL_CODES: {sorted(extra)}")
    for flag, value in ctx.proto.capabilities().as_dict().items():  # derived from capabilities(), as core does
        code = CAPABILITY_REFUSALS[flag]
        check(value != (code in declared), f"{flag}={value} but refusal_codes() {'lists' if value else 'omits'} {code}")
    return PASSED


def c0_capability_table_complete(ctx: Context) -> Outcome:
    caps = ctx.proto.capabilities()
    check(isinstance(caps, BackendCapabilities), "capabilities() is not a BackendCapabilities")
    for f in dataclasses.fields(caps):
        check(isinstance(getattr(caps, f.name), bool), f"capability {f.name} is not a bool")
    return PASSED


# tier 1 ---------------------------------------------------------------------------------

def c1_graph_integrity(ctx: Context) -> Outcome:
    for entry in ctx.entries():
        t = ctx.trace(entry)
        labels = [o.label for o in t.ops]
        check(len(labels) == len(set(labels)), f"{entry.name}: duplicate op labels")
        for op in t.ops:
            for p in op.parents:
                check(p in t.ops, f"{entry.name}: {op.label} has unknown parent {p}")
                check(op.label in t.ops[p].children, f"{entry.name}: {p} does not list child {op.label}")
                check(t.ops[p].index < op.index, f"{entry.name}: parent {p} comes after {op.label}")
            for c in op.children:
                check(op.label in t.ops[c].parents, f"{entry.name}: {c} does not list parent {op.label}")
        check(t.input_ops and t.output_ops, f"{entry.name}: no input or output op")
        for out in t.output_ops:
            check(len(out.parents) == 1, f"{entry.name}: output {out.label} has {len(out.parents)} parents")
        for call in t.module_calls:
            for label in call.output_labels:
                check(label in t.ops, f"{entry.name}: call {call.label} outputs unknown {label}")
    return PASSED


def c1_intermediates_match(ctx: Context) -> Outcome:
    at_tolerance = []
    for entry in ctx.entries():
        if entry.reseed is not None:
            entry.reseed()
        ref = ctx.proto.reference_output(entry.model, entry.args, entry.kwargs)
        t = ctx.trace(entry)
        ref_leaves = [ctx.host(v) for v in _leaves(ctx, ref)]
        out_ops = t.output_ops
        check(len(ref_leaves) == len(out_ops), f"{entry.name}: {len(out_ops)} output ops for {len(ref_leaves)} outputs")
        for r, op in zip(ref_leaves, out_ops):
            check(_matches_reference(entry, r, ctx.host(op.out)), f"{entry.name}: {op.label} differs from the reference forward")
            parent = t.ops[op.parents[0]]
            pv = parent.outs[op.parent_slots[0][1]] if parent.multi_output else parent.out
            check(_matches_reference(entry, r, ctx.host(pv)), f"{entry.name}: {parent.label} differs from the reference output")
        if entry.compiled_reference:
            at_tolerance.append(entry.name)
    if at_tolerance:  # the decision record names the entries held to a tolerance (the same on every processor)
        names = ", ".join(sorted(at_tolerance))
        return Outcome("passed", f"{names}: compared within {REFERENCE_ULPS} ulp (compiled reference); the rest bit for bit")
    return PASSED


def c1_shape_metadata_matches_payload(ctx: Context) -> Outcome:
    for entry in ctx.entries():
        t = ctx.trace(entry)
        for op in t.ops:
            for i, v in enumerate(op.outs):
                if v is None or not ctx.proto.is_tensor(v):
                    continue
                h = ctx.host(v)
                check(tuple(h.shape) == tuple(op.shapes[i]), f"{entry.name}: {op.label} shape {op.shapes[i]} vs payload {h.shape}")
    return PASSED


def _validate(ctx: Context, t: Any) -> Any:
    return ctx.proto.validate(t, None)


def c1_validation_passes(ctx: Context) -> Outcome:
    ctx.proto.capabilities().refuse_unless("validation_replay")
    for entry in ctx.entries():
        t = ctx.trace(entry)
        status = _validate(ctx, t)
        check(bool(status), f"{entry.name}: validation failed at {status.first_failure} ({status.reason})")
    return PASSED


def c1_validation_names_reason(ctx: Context) -> Outcome:
    ctx.proto.capabilities().refuse_unless("validation_replay")
    entry = ctx.first("mlp")
    t = ctx.trace(entry)
    victim = next(o for o in t.ops if o.kind == "op" and o.parents and not o.multi_output)
    h = ctx.host(victim.out)
    corrupted = np.asarray(h + 1).astype(h.dtype) if h.dtype != bool else ~h
    victim._outputs = (_like(ctx, victim.out, corrupted),)
    status = _validate(ctx, t)
    check(not bool(status), "validation passed on a corrupted payload")
    check(status.reason in VALIDATION_REASONS, f"reason {status.reason!r} is not in VALIDATION_REASONS")
    check(status.first_failure in (victim.label, *victim.children), f"validation blamed {status.first_failure}, not {victim.label}")
    return PASSED


def _like(ctx: Context, original: Any, values: np.ndarray) -> Any:
    """A framework value holding `values`, built the way the backend's payloads are
    (`SupportsHostValues.from_host`; a backend without it keeps numpy payloads)."""
    if supports(ctx.proto, SupportsHostValues):
        return ctx.proto.from_host(values, like=original)
    return values


def c1_constant_parents_recorded(ctx: Context) -> Outcome:
    entry = ctx.role("constant")
    t = ctx.trace(entry)
    consts = [o for o in t.ops if o.kind == "constant"]
    check(bool(consts), "no constant op recorded for a closure tensor")
    for c in consts:
        check(c.parents == (), f"constant {c.label} has parents")
        check(bool(c.children), f"constant {c.label} feeds no op")
        check(c.saved, f"constant {c.label} has no saved payload")
    return PASSED


def c1_rng_consumed_once(ctx: Context) -> Outcome:
    entry = ctx.role("random")
    check(entry.reseed is not None, "the random model has no reseed callable")
    entry.reseed()
    ref = [ctx.host(v) for v in _leaves(ctx, ctx.proto.reference_output(entry.model, entry.args, entry.kwargs))]
    t = ctx.trace(entry)  # reseeds first
    got = [ctx.host(o.out) for o in t.output_ops]
    check(len(ref) == len(got) and all(_same(a, b) for a, b in zip(ref, got)),
          "the traced random forward differs from one plain forward from the same state")
    return PASSED


def c1_no_silent_gap(ctx: Context) -> Outcome:
    counters = _op_counters(ctx)
    for entry in ctx.entries():
        t = ctx.trace(entry)
        check(t.provenance.verified, f"{entry.name}: capture not verified ({t.provenance.verification_reason})")
        if entry.name in counters:  # the backend's independent counter of a plain forward's framework calls
            if entry.reseed is not None:
                entry.reseed()
            want, got = counters[entry.name](entry.model, *entry.args, **entry.kwargs), sum(o.kind == "op" for o in t.ops)
            check(want == got, f"{entry.name}: {got} ops recorded, the independent counter saw {want} framework calls")
        for op in t.ops:
            if op.kind == "op":
                check(bool(op.parents) or not op.args_template or _literal_only(op),
                      f"{entry.name}: {op.label} has tensor arguments but no recorded parent")
        for out in t.output_ops:
            check(bool(out.parents), f"{entry.name}: output {out.label} has no producer")
    if counters:
        return Outcome("passed", f"op counts equal the backend's independent call counter for {len(counters)} entries")
    return PASSED


def _op_counters(ctx: Context) -> dict[str, Callable[..., int]]:
    """Optional `count_ops(model, *args, **kwargs) -> int` of the backend's zoo entries: the
    number of array-producing framework calls a plain forward makes, counted without the
    capture (MLX supplies one; the zoo is re-read because `ZooEntry` does not carry it)."""
    raw = ctx.spec.zoo() if getattr(ctx.spec, "zoo", None) is not None else {}
    return {n: d["count_ops"] for n, d in raw.items() if isinstance(d, dict) and callable(d.get("count_ops"))}


def _literal_only(op: Any) -> bool:
    from torchlens.build.events import ArgRef

    return not any(isinstance(a, ArgRef) and a.address is None for a in (op.args_template or ()))


# c1 refusal cells -------------------------------------------------------------------------

_CAPABILITY_REQUEST: dict[str, Callable[[Context, ZooEntry], Any]] = {
    "backward_capture": lambda ctx, e: ctx.trace(e, capture=tl.CaptureOptions(backward_ready=True, save_grads=True)),
    "validation_replay": lambda ctx, e: ctx.proto.validate(ctx.trace(e), None),
}
for _option, _flag in OPTION_CAPABILITY.items():
    _CAPABILITY_REQUEST[_flag] = (lambda opt: (lambda ctx, e: ctx.trace(e, **{opt: True})))(_option)


def refusal_cell(flag: str) -> Callable[[Context], Outcome]:
    code = CAPABILITY_REFUSALS[flag]

    def cell(ctx: Context) -> Outcome:
        entry = ctx.first()
        try:
            _CAPABILITY_REQUEST[flag](ctx, entry)
        except BackendUnsupportedError as exc:
            check(exc.code == code, f"refused with {exc.code!r}, expected {code!r}")
            return PASSED
        raise CellFailure(f"{flag}=False but the request was not refused")

    cell.__name__ = f"c1_refusal_{flag}"
    return cell


def option_refusal_cell(option: str) -> Callable[[Context], Outcome]:
    def cell(ctx: Context) -> Outcome:
        entry = ctx.first()
        try:
            ctx.trace(entry, **{option: object()})
        except BackendUnsupportedError as exc:
            allowed = {"trace_option_unsupported"}
            if option in OPTION_CAPABILITY:
                allowed.add(CAPABILITY_REFUSALS[OPTION_CAPABILITY[option]])
            check(exc.code in allowed, f"refused with {exc.code!r}, expected one of {sorted(allowed)}")
            return PASSED
        raise CellFailure(f"option {option}= is outside trace_options() but was not refused")

    cell.__name__ = f"c1_refusal_trace_option_{option}"
    return cell


# tier 2 ---------------------------------------------------------------------------------

def _io_available() -> bool:
    return importlib.util.find_spec("torchlens.io.bundle") is not None or hasattr(tl.Trace, "save")


def _roundtrip(ctx: Context, entry: ZooEntry) -> tuple[Any, Any]:
    t = ctx.trace(entry)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{entry.name}.tlspec"
        t.save(path)
        loaded = tl.load(path)
        for op in loaded.ops:  # materialise inside the temporary directory
            if op.saved:
                op.outs
    return t, loaded


def _durable_unavailable() -> Outcome | None:
    if not hasattr(tl.Trace, "save") or not hasattr(tl, "load"):
        return Outcome("unsupported", "persistence (Trace.save / tl.load) is not available in this core")
    return None


def c2_payload_values_equal(ctx: Context) -> Outcome:
    gap = _durable_unavailable()
    if gap is not None:
        return gap
    for entry in ctx.entries():
        t, loaded = _roundtrip(ctx, entry)
        check(loaded.labels == t.labels, f"{entry.name}: labels changed on load")
        for a, b in zip(t.ops, loaded.ops):
            check(a.parents == b.parents, f"{entry.name}: {a.label} parents changed on load")
            if a.saved:
                for va, vb in zip(a.outs, b.outs):
                    if ctx.proto.is_tensor(va):
                        check(_same(ctx.host(va), ctx.host(vb)), f"{entry.name}: {a.label} payload changed on load")
    return PASSED


def c2_validation_after_load(ctx: Context) -> Outcome:
    gap = _durable_unavailable()
    if gap is not None:
        return gap
    ctx.proto.capabilities().refuse_unless("validation_replay")
    for entry in ctx.entries():
        _, loaded = _roundtrip(ctx, entry)
        status = _validate(ctx, loaded)
        check(bool(status), f"{entry.name}: validation after load failed at {status.first_failure} ({status.reason})")
    return PASSED


# tier 3: edits and gradients against each entry's hand-written forward ---------------------
#
# Each zoo entry supplies an `EditOracle` (`torchlens_conformance.zoo`): the model's computation
# written by hand in framework code with a `tap(label, value)` at the op outputs it
# reproduces. The cells edit one mid-graph op through `trace.fork().do(site, edit)` (the replay
# engine) and compare with the hand forward edited at the same point; they never compare the
# library with itself. Edit values are built on the host (numpy) and handed to both sides.

#: allclose tolerance between an edited replay and the edited hand forward (issue 14: 1e-6).
C3_RTOL = 1e-6
C3_ATOL = 1e-6


def _c3_oracles(ctx: Context, flag: str, need_grads: bool = False) -> tuple[list[tuple[ZooEntry, Any]], list[str]]:
    """(entry, oracle) pairs to check and the named not-applicable entries. Fails on an
    entry that supplies neither an oracle nor a reason, and when no entry supplies one."""
    entries = ctx.entries()
    if not ctx.proto.capabilities().as_dict()[flag]:
        raise CellUnsupported(f"unsupported: {flag}")
    pairs, not_applicable = [], []
    for e in entries:
        reason = getattr(e, "c3_not_applicable", None)
        oracle = getattr(e, "c3", None)
        check(getattr(e, "c3_error", None) is None, str(getattr(e, "c3_error", "")))
        if reason:
            not_applicable.append(f"{e.name} ({reason})")
            continue
        check(oracle is not None, f"{e.name}: the zoo entry supplies no c3 oracle and no not_applicable reason")
        if need_grads and oracle.grads is None:
            not_applicable.append(f"{e.name} (gradients: {oracle.grads_not_applicable})")
            continue
        pairs.append((e, oracle))
    check(bool(pairs), "no zoo entry supplies a c3 oracle")
    return pairs, not_applicable


def _c3_detail(pairs: list, not_applicable: list[str], extra: str = "") -> Outcome:
    text = f"{len(pairs)} entries checked ({', '.join(e.name for e, _ in pairs)})"
    if extra:
        text += f"; {extra}"
    if not_applicable:
        text += f"; not applicable ({len(not_applicable)}): " + "; ".join(not_applicable)
    return Outcome("passed", text)


def _hand_forward(ctx: Context, entry: ZooEntry, oracle: Any, edit: Callable[[Any], Any] | None,
                  args: tuple | None = None, kwargs: dict | None = None) -> tuple[list[np.ndarray], Any]:
    """The entry's hand forward (after its reseed) with `edit` applied at the site: its
    output leaves on the host and the site's value before the edit (None: never reached)."""
    seen: dict[str, Any] = {}

    def tap(label: str, value: Any) -> Any:
        if label != oracle.site:
            return value
        seen["site"] = value
        return edit(value) if edit is not None else value

    if entry.reseed is not None:
        entry.reseed()
    out = oracle.forward(tap, *(entry.args if args is None else args), **(entry.kwargs if kwargs is None else kwargs))
    check("site" in seen, f"{entry.name}: the hand forward never reaches its site {oracle.site!r}")
    return [ctx.host(v) for v in _leaves(ctx, out)], seen["site"]


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and bool(np.allclose(a, b, rtol=C3_RTOL, atol=C3_ATOL, equal_nan=True)))


def _outputs(ctx: Context, t: Any) -> list[np.ndarray]:
    return [ctx.host(o.out) for o in t.output_ops]


def _captured_against_oracle(ctx: Context, entry: ZooEntry, oracle: Any) -> Any:
    """Capture the entry and check the oracle is the model's computation: its site is an op
    of the trace, and the unedited hand forward reproduces the site value and the outputs."""
    t = ctx.trace(entry)
    check(oracle.site in t.labels, f"{entry.name}: the oracle's site {oracle.site!r} is not an op of the trace")
    clean, site_value = _hand_forward(ctx, entry, oracle, None)
    check(_close(ctx.host(t.ops[oracle.site].out), ctx.host(site_value)),
          f"{entry.name}: the hand forward's value at {oracle.site} differs from the captured one (oracle is wrong)")
    got = _outputs(ctx, t)
    check(len(got) == len(clean) and all(_close(a, b) for a, b in zip(got, clean)),
          f"{entry.name}: the unedited hand forward differs from the captured outputs (oracle is wrong)")
    return t


def _host_edit(ctx: Context, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Any], Any]:
    """A hand-forward edit: `fn` on the host copy, back as the framework's value."""
    return lambda v: _like(ctx, v, fn(ctx.host(v)))


def _edited_matches(ctx: Context, what: str, make: Callable[[Context, Any, Any], tuple[Any, Callable[[Any], Any]]]
                    ) -> Outcome:
    """For every oracle: fork the capture, apply the library edit the replay engine runs,
    and compare every output with the hand forward under the matching hand edit."""
    pairs, na = _c3_oracles(ctx, "interventions")
    for entry, oracle in pairs:
        t = _captured_against_oracle(ctx, entry, oracle)
        before = _outputs(ctx, t)
        library_edit, hand_edit = make(ctx, t.ops[oracle.site], oracle)
        f = t.fork()
        f.do(oracle.site, library_edit)
        got = _outputs(ctx, f)
        want, _ = _hand_forward(ctx, entry, oracle, hand_edit)
        check(len(got) == len(want), f"{entry.name}: {len(got)} outputs after the edit, hand forward has {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            check(_close(g, w), f"{entry.name}: output {i} after {what} at {oracle.site} differs from the edited "
                                f"hand forward")
        check(all(_same(a, b) for a, b in zip(before, _outputs(ctx, t))),
              f"{entry.name}: editing the fork changed the original trace's outputs")
    return _c3_detail(pairs, na, f"site edited through trace.fork().do (replay), allclose {C3_ATOL:g}")


def _replacement(h: np.ndarray) -> np.ndarray:
    """A fixed value of the site's shape and dtype, unlike any activation."""
    return (np.linspace(-2.0, 3.0, h.size).reshape(h.shape) if h.size else h).astype(h.dtype)


def c3_edit_zero_matches_oracle(ctx: Context) -> Outcome:
    return _edited_matches(ctx, "zero_ablate", lambda ctx, op, o: (
        tl.intervention.zero_ablate(), _host_edit(ctx, np.zeros_like)))


C3_SCALE = 2.5


def c3_edit_scale_matches_oracle(ctx: Context) -> Outcome:
    return _edited_matches(ctx, f"scale({C3_SCALE})", lambda ctx, op, o: (
        tl.intervention.scale(C3_SCALE), _host_edit(ctx, lambda h: (h * np.asarray(C3_SCALE, h.dtype)).astype(h.dtype))))


def c3_edit_replace_matches_oracle(ctx: Context) -> Outcome:
    def make(ctx: Context, op: Any, o: Any) -> tuple[Any, Callable[[Any], Any]]:
        value = _like(ctx, op.out, _replacement(ctx.host(op.out)))
        return tl.intervention.replace_with(value), _host_edit(ctx, _replacement)
    return _edited_matches(ctx, "replace_with", make)


def c3_patch_from_matches_oracle(ctx: Context) -> Outcome:
    """`patch_from` a donor trace captured on the oracle's other inputs equals the hand
    forward with the site set to the hand forward's own value on those inputs."""
    pairs, na = _c3_oracles(ctx, "interventions")
    for entry, oracle in pairs:
        t = _captured_against_oracle(ctx, entry, oracle)
        donor_entry = dataclasses.replace(entry, args=oracle.other_args, kwargs=oracle.other_kwargs)
        donor = ctx.trace(donor_entry)
        _, donor_site = _hand_forward(ctx, entry, oracle, None, oracle.other_args, oracle.other_kwargs)
        donor_host = ctx.host(donor_site)
        check(not _same(donor_host, ctx.host(t.ops[oracle.site].out)),
              f"{entry.name}: the other inputs give the same value at {oracle.site}; patching would prove nothing")
        f = t.fork()
        f.do(oracle.site, tl.intervention.patch_from(donor))
        want, _ = _hand_forward(ctx, entry, oracle, _host_edit(ctx, lambda h: donor_host))
        got = _outputs(ctx, f)
        check(len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want)),
              f"{entry.name}: patch_from at {oracle.site} differs from the hand forward with the donor's value")
    return _c3_detail(pairs, na, "donor traced on the oracle's other inputs")


def c3_noop_edit_bit_exact(ctx: Context) -> Outcome:
    """scale(1.0) and patching the site from the trace itself replay to the captured outputs,
    bit for bit."""
    pairs, na = _c3_oracles(ctx, "interventions")
    for entry, oracle in pairs:
        t = ctx.trace(entry)
        check(oracle.site in t.labels, f"{entry.name}: the oracle's site {oracle.site!r} is not an op of the trace")
        before = _outputs(ctx, t)
        for name, edit in (("scale(1.0)", tl.intervention.scale(1.0)), ("patch_from(itself)", tl.intervention.patch_from(t))):
            f = t.fork()
            f.do(oracle.site, edit)
            got = _outputs(ctx, f)
            check(len(got) == len(before) and all(_same(a, b) for a, b in zip(before, got)),
                  f"{entry.name}: the no-op edit {name} at {oracle.site} changed the outputs")
            run = f.last_run or {}
            check(run.get("engine") == "replay" and oracle.site in run.get("origins", ()),
                  f"{entry.name}: the no-op edit {name} at {oracle.site} did not run the replay engine")
    return _c3_detail(pairs, na, "scale(1.0) and patch_from(itself)")


def c3_grads_match_autodiff(ctx: Context) -> Outcome:
    """With backward_ready and save_grads, every op gradient the hand forward taps equals the
    framework's own autodiff of the hand forward; the count of saved gradients left untapped
    is named."""
    pairs, na = _c3_oracles(ctx, "backward_capture", need_grads=True)
    compared = saved = 0
    complete = []
    for entry, oracle in pairs:
        t = ctx.trace(entry, capture=tl.CaptureOptions(backward_ready=True, save_grads=True))
        oracle.backward(t, oracle.loss)
        if entry.reseed is not None:
            entry.reseed()
        want = oracle.grads(oracle.loss, *entry.args, **entry.kwargs)
        check(oracle.site in want, f"{entry.name}: the gradient oracle does not tap the site {oracle.site!r}")
        have = {o.label for o in t.ops if o.has_grad}
        saved += len(have)
        for label, g in want.items():
            check(label in t.labels, f"{entry.name}: the gradient oracle taps {label!r}, not an op of the trace")
            check(label in have, f"{entry.name}: autodiff gives {label} a gradient but the trace saved none")
            op = t.ops[label]
            check(not op.multi_output, f"{entry.name}: the gradient oracle taps the multi-output op {label}")
            check(_close(ctx.host(op.grad), ctx.host(g)), f"{entry.name}: the saved gradient of {label} differs from "
                                                          "autodiff of the hand forward")
            compared += 1
        if have <= set(want):
            complete.append(entry.name)
    return _c3_detail(pairs, na, f"{compared} of {saved} saved op gradients compared with autodiff; every saved "
                                 f"gradient compared for {', '.join(complete) or 'no entry'}")


C3_CELLS = (c3_edit_zero_matches_oracle, c3_edit_scale_matches_oracle, c3_edit_replace_matches_oracle,
            c3_patch_from_matches_oracle, c3_noop_edit_bit_exact, c3_grads_match_autodiff)


BASE_CELLS: dict[str, Callable[[Context], Outcome]] = {
    f.__name__: f for f in (
        c0_protocol_complete, c0_framework_requirement_consistent, c0_refusal_codes_registered,
        c0_capability_table_complete,
        c1_graph_integrity, c1_intermediates_match, c1_shape_metadata_matches_payload, c1_validation_passes,
        c1_validation_names_reason, c1_constant_parents_recorded, c1_rng_consumed_once, c1_no_silent_gap,
        c2_payload_values_equal, c2_validation_after_load, *C3_CELLS,
    )
}


def tier_of(cell_id: str) -> int:
    return int(cell_id[1])


def cells_for(proto: Any) -> dict[str, Callable[[Context], Outcome]]:
    """The base cells plus the backend's refusal cells (one per False flag and per public
    trace option outside its trace_options())."""
    out = dict(BASE_CELLS)
    caps = proto.capabilities().as_dict()
    for flag, value in caps.items():
        if not value:
            out[f"c1_refusal_{flag}"] = refusal_cell(flag)
    declared = set(proto.trace_options())
    for option in PUBLIC_TRACE_OPTIONS:
        if option not in declared:
            out[f"c1_refusal_trace_option_{option}"] = option_refusal_cell(option)
    return dict(sorted(out.items(), key=lambda kv: (tier_of(kv[0]), kv[0])))


def run_cell(ctx: Context, cell: Callable[[Context], Outcome]) -> Outcome:
    """Run one cell: a typed refusal is `unsupported`, anything else unexpected `failed`."""
    try:
        return cell(ctx)
    except CellFailure as exc:
        return Outcome("failed", str(exc))
    except CellUnsupported as exc:
        return Outcome("unsupported", str(exc))
    except BackendUnsupportedError as exc:
        return Outcome("unsupported", f"refused: {exc.code}")
    except Exception as exc:  # an untyped exception is a failure, named
        return Outcome("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def make_context(name: str) -> Context:
    spec = tl.backends.get_spec(name)
    proto = tl.backends.get_protocol(name)
    return Context(spec, proto, load_zoo(spec))
