"""Structural output names of module calls (facets spec, "Structural output names come from
the captured ContainerSpec"): while capturing, the recorder's global forward hook notes, for each module
call that returned a container (not one plain tensor), the container path of every returned
tensor; after the build they are stored per call as

    trace.annotations["module_output_names"][call label] = [[name, positional name, op label, slot], ...]

Names: a named field keeps its name (`values`/`indices` of `torch.topk`, a ModelOutput's
`last_hidden_state`, a namedtuple field), positional leaves read `out0`, `out1.0`, and the
recurrent layers whose tuples torch documents by name get those names (`nn.LSTM`: `output`,
`h_n`, `c_n`; `nn.GRU`/`nn.RNN`: `output`, `h_n`). The positional name is kept alongside so a
typed path `(1, 0)` or `"out1.0"` still resolves. A call returning one plain tensor records
nothing (its facet is `out`): the hook tests its type and moves on, so capture cost stays low."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

#: torch's documented names of recurrent layers' positional outputs, by positional path
_DOCUMENTED: dict[type, dict[tuple, str]] = {
    nn.LSTM: {(0,): "output", (1, 0): "h_n", (1, 1): "c_n"},
    nn.GRU: {(0,): "output", (1,): "h_n"},
    nn.RNN: {(0,): "output", (1,): "h_n"},
}


def _leaves(obj: Any, named: tuple, pos: tuple, out: list, depth: int = 0) -> None:
    """(named path, positional path, tensor) per tensor leaf, in return order."""
    if isinstance(obj, Tensor):
        out.append((named, pos, obj))
        return
    if depth > 16:
        return
    if isinstance(obj, tuple):
        fields = getattr(type(obj), "__match_args__", None) if type(obj) is not tuple else None
        for i, item in enumerate(obj):
            key = fields[i] if fields is not None and i < len(fields) else i
            _leaves(item, named + (key,), pos + (i,), out, depth + 1)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            _leaves(item, named + (i,), pos + (i,), out, depth + 1)
    elif isinstance(obj, dict):
        for i, (key, item) in enumerate(obj.items()):
            _leaves(item, named + (str(key),), pos + (i,), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for i, f in enumerate(dataclasses.fields(obj)):
            _leaves(getattr(obj, f.name, None), named + (f.name,), pos + (i,), out, depth + 1)


def positional_name(pos: tuple) -> str:
    return "out" + ".".join(str(i) for i in pos)


def leaf_names(module: Any, output: Any) -> list[tuple[str, str, Tensor]]:
    """(name, positional name, tensor) per tensor leaf of a module's returned container."""
    leaves: list = []
    _leaves(output, (), (), leaves)
    documented = _DOCUMENTED.get(type(module))
    if documented is None:
        for cls, names in _DOCUMENTED.items():
            if isinstance(module, cls):
                documented = names
                break
    first: list[str] = []
    for named, pos, _ in leaves:
        if documented is not None and pos in documented:
            first.append(documented[pos])
        elif named and isinstance(named[-1], str):
            first.append(named[-1])
        elif any(isinstance(c, str) for c in named):
            first.append(".".join(str(c) for c in named))
        elif len(leaves) == 1:
            first.append("out")  # a one-tensor container reads like a single tensor output
        else:
            first.append(positional_name(pos))
    counts: dict[str, int] = {}
    for n in first:
        counts[n] = counts.get(n, 0) + 1
    result = []
    for n, (named, pos, t) in zip(first, leaves):
        if counts[n] > 1:  # a field name repeated at different depths: the full path keeps them apart
            n = ".".join(str(c) for c in named)
        result.append((n, positional_name(pos), t))
    return result


class _Names:
    """What `install` returns: the names noted so far, removed with the recorder's hooks
    (it registers no hook of its own, so `remove` has nothing to undo)."""

    id = None

    def __init__(self) -> None:
        self._tl_output_names: dict[tuple[str, int], list] = {}

    def remove(self) -> None:
        return None


def install(rec: Any) -> Any:
    """Have the recorder's own global forward hook (`Recorder.post_hook`) call the namer for
    every module call of this capture that returned a container (one hook call per module
    call, not two); returns the handle `store` reads the names from."""
    handle = _Names()
    names = handle._tl_output_names
    tags = rec.tags

    def name_outputs(module: Any, addr: str, call: int, output: Any) -> None:
        rows = []
        for name, pos, t in leaf_names(module, output):
            tag = tags.get(id(t))
            if tag is not None:
                rows.append((name, pos, tag[0], tag[1]))
        if rows:
            names[(addr, call)] = rows

    rec.name_outputs = name_outputs
    return handle


def store(trace: Any, handle: Any) -> None:
    """Resolve the recorded names to op labels and keep them in the trace's annotations
    (saved with it, like `module_output_slots`)."""
    names = getattr(handle, "_tl_output_names", None)
    if not names:
        return
    label_of = {op.event_id: op for op in trace._ops.values()}
    out: dict[str, list[list]] = {}
    for (addr, call), rows in names.items():
        resolved = []
        for name, pos, eid, slot in rows:
            op = label_of.get(eid)
            if op is not None:
                resolved.append([name, pos, op.label, int(slot) if op.multi_output else None])
        if resolved:
            out[f"{addr}:{call}"] = resolved
    if out:
        trace.annotations["module_output_names"] = out


__all__ = ["install", "store", "leaf_names", "positional_name"]
