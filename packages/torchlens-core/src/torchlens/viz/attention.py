"""Which edges of a trace carry an attention op's query, key and value (for drawing labels).

Two shapes of attention are recognised, by structure only (no names are guessed):
- a fused op (`scaled_dot_product_attention` and friends): its first three parents, in
  argument order, are Q, K and V;
- the eager pattern `softmax(matmul(q, k^T) ...)` then `matmul(probs, v)`: the score matmul's
  parents are Q and K, and the probability matmul's other parent is V. Between the score
  matmul and the softmax only a few elementwise steps (scale, mask, cast) may sit, and between
  the softmax and its matmul only dropout/cast-like steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op
    from torchlens.records.trace import Trace

FUSED = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                   "dot_product_attention", "multi_head_attention_forward"})
MATMULS = frozenset({"matmul", "bmm", "einsum", "baddbmm", "__matmul__", "dot_general", "dot"})
SOFTMAX = frozenset({"softmax", "_softmax", "safe_softmax", "_safe_softmax"})
# steps allowed between the score matmul and the softmax (scale, mask, bias, cast)
_SCORE_STEPS = frozenset({"div", "truediv", "__truediv__", "mul", "__mul__", "add", "__add__", "sub", "where",
                          "masked_fill", "masked_fill_", "to", "float", "type", "__getitem__", "view", "reshape",
                          "full", "tril", "softcap", "tanh"})
# steps allowed between the softmax and the probability matmul
_PROB_STEPS = frozenset({"dropout", "to", "type", "float", "half", "bfloat16", "contiguous", "view", "reshape"})


def _walk(trace: "Trace", start: "Op", steps: frozenset, target: frozenset, down: bool, hops: int = 4) -> "Op | None":
    """The first op of `target` reached from `start` through at most `hops` ops of `steps`."""
    frontier = [start]
    for _ in range(hops + 1):
        nxt = []
        for op in frontier:
            for label in (op.children if down else op.parents):
                o = trace._ops.get(label)
                if o is None:
                    continue
                if o.func_name in target:
                    return o
                if o.func_name in steps:
                    nxt.append(o)
        frontier = nxt
    return None


def qkv_edges(trace: "Trace") -> dict[tuple[str, str], str]:
    """(parent op label, attention op label) -> "Q", "K", "V" (joined, e.g. "Q,K", when one
    tensor plays two roles)."""
    roles: dict[tuple[str, str], list[str]] = {}

    def mark(parent: str, op: "Op", role: str) -> None:
        got = roles.setdefault((parent, op.label), [])
        if role not in got:
            got.append(role)

    for op in trace._ops.values():
        parents = list(op.parents)
        if op.func_name in FUSED and len(parents) >= 1:
            for parent, role in zip(_arg_parents(op), ("Q", "K", "V")):
                if parent is not None:
                    mark(parent, op, role)
        elif op.func_name in MATMULS and len(parents) == 2:
            probs = [p for p in parents if _is_probs(trace, trace._ops.get(p))]
            if len(probs) == 1 and parents[0] != parents[1]:
                mark(parents[1 - parents.index(probs[0])], op, "V")
            elif _walk(trace, op, _SCORE_STEPS, SOFTMAX, down=True) is not None:
                mark(parents[0], op, "Q")
                mark(parents[1], op, "K")
    return {k: ",".join(v) for k, v in roles.items()}


def _is_probs(trace: "Trace", op: "Op | None") -> bool:
    if op is None:
        return False
    if op.func_name in SOFTMAX:
        return True
    return op.func_name in _PROB_STEPS and _walk(trace, op, _PROB_STEPS, SOFTMAX, down=False, hops=2) is not None


def _arg_parents(op: "Op") -> list[str | None]:
    """The op's parents in argument order (one per position, repeated when q is k)."""
    by_event = {o.event_id: o.label for o in (op._trace._ops.get(p) for p in op.parents) if o is not None}
    slots = [by_event.get(eid) for eid, _ in (op.parent_slots or ())]
    return slots[:3] if len(slots) >= 3 else list(op.parents)[:3]
