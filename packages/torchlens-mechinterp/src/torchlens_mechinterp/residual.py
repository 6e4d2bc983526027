"""`residual_decomposition(trace, strict=True)`: the residual stream as a ComponentStack.

The walk goes BACKWARD from the captured tensor the final norm consumes. At an addition
whose one operand is an ancestor of the other, the ancestor is the spine (the stream so
far) and the other operand is a writer (a literal captured tensor); the step is recorded
with its pass-qualified label and site key. Ops with one tensor operand that the grammar
proposes as value-preserving (view, to, clone, ...) are crossed only when the payloads
prove it (torch.equal). The walk ends at the base (the embedding): an op that is not a
spine addition and has no matmul-like op among its ancestors; an op that does (the stream
was rescaled or mixed, e.g. ``x * a + f(x)``) refuses ``mi_residual_rescaled``.

The oracle is EQUALITY: accumulating the literal writers in execution order replays the
forward's own additions, so every partial sum equals the captured spine state under
torch.equal (in the captured dtype). ``strict=False`` never refuses a walk that fails: it
returns a ``closed_unresolved`` (diagnostic-only) stack with an ``unresolved_remainder`` row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError

from torchlens_mechinterp._common import (ADD_FUNCS, LINEAR_FUNCS, VALUE_PRESERVING, Ancestry, attention_addresses,
                                          component_of, final_norm_input_label, mlp_addresses)
from torchlens_mechinterp.stack import ComponentStack, SpineStep, StackRow

FUNCTION = "residual_decomposition"


def _same(a: Any, b: Any) -> bool:
    """The oracle: bitwise equality (torch.equal), never a tolerance."""
    import torch

    return bool(torch.equal(a, b))


@dataclass
class Walk:
    """The structural result of the backward walk (no payload read)."""

    target: str
    steps: list[SpineStep] = field(default_factory=list)  # in FORWARD order
    base: str | None = None
    base_parts: tuple[str, ...] = ()
    base_hops: tuple[tuple[str, str], ...] = ()
    writer_parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rescaled_at: str | None = None
    constants: dict[str, str] = field(default_factory=dict)  # step label -> parameter address

    def payload_labels(self) -> list[str]:
        """Every op whose payload the oracle reads."""
        out = [self.target]
        for s in self.steps:
            out += [s.label] + ([] if s.label in self.constants else [s.writer_label]) + [h for h, _ in s.hops]
        out += [h for h, _ in self.base_hops]
        if self.base is not None:
            out.append(self.base)
        return list(dict.fromkeys(out))

    def part_labels(self) -> list[str]:
        out = [p for parts in self.writer_parts.values() for p in parts]
        return list(dict.fromkeys(out + list(self.base_parts)))


def _tensor_args(op: Any) -> int:
    return sum(1 for a in list(op.args_template or ()) + list((op.kwargs_template or {}).values())
               if type(a).__name__ == "ArgRef" and getattr(a, "address", None) is None)


def _is_spine_add(op: Any) -> bool:
    kw = dict(op.kwargs_template or {})
    return (op.func_name in ADD_FUNCS and len(op.parents) == 2 and not op.params and "alpha" not in kw
            and _tensor_args(op) == 2)


def _is_param_add(op: Any) -> bool:
    """`x + p` with p a parameter (a learned position table, a stream bias): a constant writer."""
    kw = dict(op.kwargs_template or {})
    args = list(op.args_template or ())
    refs = [a for a in args if type(a).__name__ == "ArgRef"]
    return (op.func_name in ADD_FUNCS and len(op.parents) == 1 and len(op.params) == 1 and not kw
            and len(args) == 2 and len(refs) == 2 and _tensor_args(op) == 1)


def _broadcasts(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(small) <= len(shape) and all(a in (1, b) for a, b in zip(small[::-1], shape[::-1]))


def _is_hop(op: Any) -> bool:
    return op.func_name in VALUE_PRESERVING and len(op.parents) == 1 and not op.params


def _parts(trace: Any, anc: Ancestry, label: str) -> tuple[str, ...]:
    """A writer that is a plain sum of independent branches (a parallel block's attention +
    MLP) -> its branch labels, flattened; otherwise ``(label,)``."""
    op = trace._ops[label]
    if _is_spine_add(op):
        a, b = op.parents
        if a != b and a not in anc.of(b) and b not in anc.of(a):
            return _parts(trace, anc, a) + _parts(trace, anc, b)
    return (label,)


def walk(trace: Any, function: str = FUNCTION) -> Walk:
    """The backward walk, structural only."""
    ops = trace._ops
    target = final_norm_input_label(trace, function)
    anc = Ancestry(trace)
    w = Walk(target=target)
    steps: list[SpineStep] = []
    hops: list[tuple[str, str]] = []
    cur = target
    while True:
        op = ops[cur]
        if _is_hop(op):
            hops.append((cur, op.func_name))
            cur = op.parents[0]
            continue
        if _is_spine_add(op):
            a, b = op.parents
            spine = a if a in anc.of(b) else b if b in anc.of(a) else None
            if spine is not None and a != b:
                writer = b if spine == a else a
                steps.append(SpineStep(label=op.label, site=op.site, writer_label=writer, spine_label=spine,
                                       hops=tuple(hops)))
                w.writer_parts[writer] = _parts(trace, anc, writer)
                hops = []
                cur = spine
                continue
        if _is_param_add(op) and _broadcasts(tuple(trace._params[op.params[0]].shape), tuple(op.shape or ())):
            steps.append(SpineStep(label=op.label, site=op.site, writer_label=op.params[0], spine_label=op.parents[0],
                                   hops=tuple(hops)))
            w.constants[op.label] = op.params[0]
            hops = []
            cur = op.parents[0]
            continue
        # the base: nothing matmul-like may feed it, or the stream was rescaled / mixed here
        w.base, w.base_hops = cur, tuple(hops)
        if op.func_name in LINEAR_FUNCS or any(ops[x].func_name in LINEAR_FUNCS for x in anc.of(cur) if x in ops):
            w.rescaled_at = cur
        else:
            w.base_parts = _parts(trace, anc, cur)
        break
    w.steps = list(reversed(steps))
    return w


def residual_sites(trace: Any) -> list[str]:
    """The op labels whose payloads residual_decomposition reads (for retention_plan)."""
    return walk(trace).payload_labels()


def _name_rows(rows: list[StackRow]) -> list[StackRow]:
    """A component that writes several times (a block called in a loop) gets its call number:
    ``blk.f:1``, ``blk.f:2``, ... in execution order."""
    total: dict[str, int] = {}
    for r in rows:
        total[r.name] = total.get(r.name, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if total[r.name] > 1:
            seen[r.name] = seen.get(r.name, 0) + 1
            r = StackRow(f"{r.name}:{seen[r.name]}", r.kind, r.value, r.label, r.site, r.module, r.component,
                         r.parts)
        out.append(r)
    return out


def _writer_row(trace: Any, label: str, parts: tuple[str, ...], block: str | None, attn: set[str],
                mlp: set[str]) -> StackRow:
    op = trace._ops[label]
    if len(parts) > 1:
        named = [component_of(trace._ops[p].module, block, attn, mlp) for p in parts]
        name = "+".join(a for a, _ in named)
        kind = "+".join(k for _, k in named)
        module = block or op.module
    else:
        module, kind = component_of(op.module, block, attn, mlp)
        name = module or label
    return StackRow(name=name, kind="writer", value=op.out, label=op.label, site=op.site, module=module,
                    component=kind, parts=parts if len(parts) > 1 else ())


def residual_decomposition(trace: Any, strict: bool = True) -> ComponentStack:
    """Decompose the tensor the final norm consumes into its literal writers (see module doc).

    Returns a ComponentStack graded ``complete`` (every row a named writer: the embedding,
    then each block's attention / MLP output in execution order) whose partial sums equal
    the captured spine states under torch.equal. ``strict=False`` returns a
    ``closed_unresolved`` diagnostic stack instead of refusing."""
    import torch

    from torchlens_mechinterp.retention import require_payloads

    w = walk(trace)
    if w.rescaled_at is not None and strict:
        op = trace._ops[w.rescaled_at]
        raise MechInterpError("mi_residual_rescaled", f"the residual stream reaches {w.rescaled_at!r} "
                              f"({op.func_name} in {op.module!r}), which is not a plain addition of a writer to the "
                              "stream: the stream is rescaled or mixed there", remedy="residual_decomposition(trace, "
                              "strict=False) returns a diagnostic stack with an unresolved_remainder row",
                              label=w.rescaled_at, func=op.func_name, module=op.module)
    require_payloads(trace, w.payload_labels(), function=FUNCTION)
    ops = trace._ops
    attn, mlp = attention_addresses(trace), mlp_addresses(trace)
    # value-preserving hops: payload-verified
    for s in list(w.steps) + [None]:
        for label, fn in (s.hops if s is not None else w.base_hops):
            op = ops[label]
            src = ops[op.parents[0]].out
            ok = op.out.numel() == src.numel() and op.out.dtype == src.dtype and torch.equal(
                op.out, src.reshape(op.out.shape))
            if not ok:
                raise MechInterpError("mi_residual_hop_unverified", f"the spine hop {label!r} ({fn}) changed the "
                                      "payload: it is not value-preserving here", remedy="report the model: its "
                                      "residual stream passes a transform the kit cannot cross", label=label, func=fn)
    base_op = ops[w.base]
    if w.rescaled_at is None:
        bmod, bkind = component_of(base_op.module, None, attn, mlp)
        base = StackRow(name="embed", kind="writer", value=base_op.out, label=base_op.label, site=base_op.site,
                        module=bmod, component="embed", parts=w.base_parts if len(w.base_parts) > 1 else ())
    else:
        base = StackRow(name="unresolved_remainder", kind="unresolved_remainder", value=base_op.out,
                        label=base_op.label, site=base_op.site, module=base_op.module, component="unresolved")
    rows = [base]
    partial = base.value
    for h, _ in w.base_hops[::-1]:
        partial = partial.reshape(ops[h].out.shape)
    checked: list[str] = []
    failed: str | None = None
    for s in w.steps:
        add = ops[s.label]
        if s.label in w.constants:  # a parameter added to the stream: a verified constant row
            p = trace._params[w.constants[s.label]]
            rows.append(StackRow(name=p.address, kind="constant", value=p.value, label=s.label, site=s.site,
                                 module=p.module if isinstance(p.module, str) else None, component="constant"))
            partial = partial + p.value
        else:
            rows.append(_writer_row(trace, s.writer_label, w.writer_parts[s.writer_label], add.module, attn, mlp))
            partial = partial + ops[s.writer_label].out
        if not _same(partial, add.out):
            failed = s.label
            break
        checked.append(s.label)
        for h, _ in s.hops[::-1]:
            partial = partial.reshape(ops[h].out.shape)
    if failed is None and not _same(partial, ops[w.target].out):
        failed = w.target
    receipt = {"oracle": "torch.equal", "checked_states": checked, "n_steps": len(w.steps),
               "dtype": str(ops[w.target].out.dtype), "device": str(ops[w.target].out.device),
               "degrade": None if (ops[w.target].out.dtype == torch.float32 and ops[w.target].out.device.type == "cpu")
               else "off the fp32/CPU envelope: equality still required of the replayed adds in the captured dtype",
               "failed_at": failed, "target": w.target}
    if failed is not None:
        if strict:
            raise MechInterpError("mi_residual_open", f"the partial sum at {failed!r} differs from the captured "
                                  "spine state under torch.equal", remedy="residual_decomposition(trace, "
                                  "strict=False) returns a diagnostic stack", label=failed)
        rows = rows[:len(checked) + 1]
        done = rows[0].value
        for r in rows[1:]:
            done = done + r.value
        rows.append(StackRow(name="unresolved_remainder", kind="unresolved_remainder",
                             value=ops[w.target].out - done, component="unresolved"))
    kinds = {r.kind for r in rows}
    grade = "closed_unresolved" if "unresolved_remainder" in kinds else "closed_constant" if "constant" in kinds \
        else "complete"
    receipt["diagnostic_only"] = grade == "closed_unresolved"
    return ComponentStack(rows=_name_rows(rows), grade=grade, target_label=w.target, steps=list(w.steps),
                          receipt=receipt)


ResidualDecomposition = ComponentStack

__all__ = ["residual_decomposition", "ResidualDecomposition", "residual_sites", "walk", "Walk"]
