"""Run folding for `Trace.draw(fold_repeats=True)` (spec: Run folding).

A run is two or more consecutive sibling module calls (same parent call, adjacent in the
order the parent called its children) of one class, each reading what the one before it
made (a chain: parallel siblings such as q/k/v projections never fold), with distinct addresses (the same
module called again is recurrence, drawn `(xN)` by `rolled=True`, never folded here) and
an identical inside: the same ops in the same order, with the same callables, kinds, output
shapes, parameter shapes, relative module paths and internal wiring. The first member is
drawn as usual (the representative); the other N members become one `+N more` node.
Rendering only: nothing here changes the Trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace
    from torchlens.viz.ir import Unit


@dataclass(frozen=True)
class RepeatRun:
    """One folded run: `members[0]` is drawn, `members[1:]` fold into the `+N more` node.

    `members` are cluster keys (module call labels such as `"h.1:1"`, or module addresses
    when rolled); `addresses` the matching module addresses; `level` their nesting level
    (0 = top-level submodule); `num_ops` the ops inside each member."""

    level: int
    members: tuple[str, ...]
    addresses: tuple[str, ...]
    class_name: str
    num_ops: int

    @property
    def num_more(self) -> int:
        return len(self.members) - 1

    @property
    def title(self) -> str:
        return f"+{self.num_more} more"

    @property
    def span(self) -> str:
        rest = self.addresses[1:]
        return rest[0] if len(rest) == 1 else f"{rest[0]} .. {rest[-1]}"


def _signature(trace: "Trace", units: list["Unit"], level: int, address: str) -> tuple:
    """What must match for two sibling calls to count as identical blocks."""
    params = trace._params
    inside: dict[str, int] = {}
    for u in units:
        for op in u.ops:
            inside.setdefault(op.label, len(inside))
    cut = len(address) + 1
    sig = []
    for u in units:
        op = u.ops[0]
        rel = tuple(a[cut:] for a in u.addresses[level + 1:])
        pshapes = tuple(tuple(params[p].shape) if p in params else None for p in op.params)
        wires = tuple(inside.get(p, -1) for p in op.parents)
        sig.append((rel, op.kind, op.func_name, tuple(op.shapes), pshapes, wires, len(u.ops)))
    return tuple(sig)


def find_runs(trace: "Trace", units: list["Unit"]) -> list[RepeatRun]:
    """Every maximal run of identical consecutive sibling calls, outermost first."""
    children: dict[Any, list[tuple[str, str, int]]] = {}
    seen: set[str] = set()
    members: dict[str, list["Unit"]] = {}
    for u in units:
        for i, key in enumerate(u.keys):
            members.setdefault(key, []).append(u)
            if key in seen:
                continue
            seen.add(key)
            parent = u.keys[i - 1] if i else None
            children.setdefault(parent, []).append((key, u.addresses[i], i))
    modules = trace._modules

    def cls(address: str) -> str | None:
        mod = modules.get(address)
        return mod.class_name if mod is not None else None

    sigs: dict[str, tuple] = {}
    labels: dict[str, set[str]] = {}

    def fed_by(key: str, prev: str) -> bool:
        """Whether the call `key` reads something the call `prev` made (a chain)."""
        if prev not in labels:
            labels[prev] = {op.label for u in members[prev] for op in u.ops}
        made = labels[prev]
        return any(p in made for u in members[key] for op in u.ops for p in op.parents)

    def sig(key: str, address: str, level: int) -> tuple:
        if key not in sigs:
            sigs[key] = _signature(trace, members[key], level, address)
        return sigs[key]

    runs: list[RepeatRun] = []
    for kids in children.values():
        i = 0
        while i < len(kids):
            key, addr, level = kids[i]
            name = cls(addr)
            j = i + 1
            addrs = {addr}
            while j < len(kids) and name is not None:
                k2, a2, l2 = kids[j]
                if (cls(a2) != name or a2 in addrs or sig(k2, a2, l2) != sig(key, addr, level)
                        or not fed_by(k2, kids[j - 1][0])):
                    break
                addrs.add(a2)
                j += 1
            if j - i >= 2:
                run = kids[i:j]
                runs.append(RepeatRun(level, tuple(k for k, _, _ in run), tuple(a for _, a, _ in run),
                                      name or "", sum(len(u.ops) for u in members[key])))
            i = j
    runs.sort(key=lambda r: r.level)
    return runs


def hidden_members(runs: list[RepeatRun]) -> dict[str, int]:
    """Cluster key of every folded (non-representative) member -> index of its run."""
    out: dict[str, int] = {}
    for n, run in enumerate(runs):
        for key in run.members[1:]:
            out[key] = n
    return out
