"""Arming gradient edits on a kept autograd graph after capture (core's `GradientArmingOps`).

A rule staged with `engine="set_only"` on a backward-ready capture is applied by
`trace.backward`: before the backward runs, a hook is registered on the autograd node that
produced each output slot of the rule's sites, and it edits the gradient arriving at that slot
(what a tensor hook on the live output does). The live output itself is not kept; the op's
saved value reaches its node: a `save_mode="copy"` payload is a clone of the output, so its
node's first input is (output's node, output slot); a `save_mode="reference"` payload not
detached is the output itself. A detached payload, a `view` payload, an unsaved op or a loaded
trace keeps no link to the graph: those labels are returned and nothing is registered.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _capture_options(trace: Any) -> Any:
    from torchlens.backends.sdk import CaptureOptions, TraceOptions

    opts = trace.options
    if isinstance(opts, TraceOptions):
        return opts.capture_options()
    return opts if isinstance(opts, CaptureOptions) else None


#: nodes `save_fn`'s copy makes, and the op names whose own output node is one of them (a
#: payload of such an op cannot tell a saved copy from the output itself: not armed)
_COPY_NODES = frozenset({"CloneBackward0", "ToCopyBackward0"})
_COPYING_OPS = frozenset({"clone", "to", "_to_copy", "contiguous", "float", "double", "half", "bfloat16", "type",
                          "type_as", "cpu", "cuda", "copy", "reshape", "flatten"})
_AMBIGUOUS = object()


def _node_of(op: Any, payload: Any) -> Any:
    """(autograd node, output slot) of the live output `payload` was saved from: the output
    itself (a copy-on-write reference or a reference payload), or a copy `save_fn` made (its
    node's first input); None when the output needs no gradient; `_AMBIGUOUS` when a copy and
    the output cannot be told apart."""
    fn = payload.grad_fn
    if fn is None:
        return None
    if type(fn).__name__ not in _COPY_NODES:
        return fn, payload.output_nr
    if op.func_name in _COPYING_OPS:
        return _AMBIGUOUS
    node, slot = fn.next_functions[0]
    return (node, slot) if node is not None else None


def arm_gradient_edits(trace: Any, labels: list[str], apply: Callable[[str, int, Any], Any]) -> list[str]:
    """See the module docstring; returns the labels that cannot be armed (then arms none)."""
    opts = _capture_options(trace)
    from torchlens_torch.backend import CaptureExtras

    extras = trace.backend_state
    live = (opts is not None and isinstance(extras, CaptureExtras) and extras.backward_ready and not extras.inference_only
            and not opts.detach_saved_activations and opts.save_mode in ("copy", "reference"))
    if not live:
        return list(labels)
    sites: list[tuple[str, int, Any, int]] = []
    bad = []
    for label in labels:
        op = trace._ops[label]
        if not op.saved:
            bad.append(label)
            continue
        for i, v in enumerate(op.outs):
            if isinstance(v, torch.Tensor):
                found = _node_of(op, v)
                if found is _AMBIGUOUS:
                    bad.append(label)
                elif found is not None:
                    sites.append((label, i, *found))
    if bad:
        return bad
    by_node: dict[int, tuple[Any, list[tuple[str, int, int]]]] = {}
    for label, i, node, slot in sites:
        by_node.setdefault(id(node), (node, []))[1].append((label, i, slot))
    for node, entries in by_node.values():
        def prehook(grad_outputs: tuple, entries: list = entries) -> tuple:
            grads = list(grad_outputs)
            for label, i, slot in entries:
                if grads[slot] is not None:
                    grads[slot] = apply(label, i, grads[slot])
            return tuple(grads)

        node.register_prehook(prehook)
    return []


__all__ = ["arm_gradient_edits"]
