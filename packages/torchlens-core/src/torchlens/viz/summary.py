"""`Trace.summary()`: a plain-text table of ops (or layers, or modules) with shapes,
bytes, FLOPs and time, under a header of trace totals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchlens.errors import InvalidArgumentError
from torchlens.viz.units import fmt_bytes, fmt_count, fmt_seconds, fmt_shape, fmt_shapes

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op
    from torchlens.records.trace import Trace

FLOP_CONVENTIONS = ("fma2", "fma1")
_MISSING = object()


def op_flops(op: "Op", convention: str) -> int | None:
    """The op's FLOPs under a convention: "fma2" counts a multiply-accumulate as 2 FLOPs
    (the recorded `flops`); "fma1" recounts it as 1 from the MAC split (flops - macs)."""
    flops, macs = op.meta.get("flops"), op.meta.get("macs")
    if convention == "fma2":
        return flops if flops is not None else (2 * macs if macs is not None else None)
    if flops is None:
        return macs
    if macs is None:
        raise InvalidArgumentError("flop_convention_unavailable",
                                   f"op {op.label!r} has {flops} FLOPs but no MAC split, so fma1 cannot recount it",
                                   remedy="use flop_convention='fma2' (the default)", label=op.label)
    return flops - macs


def check_convention(flop_convention: Any) -> str:
    if flop_convention not in FLOP_CONVENTIONS:
        raise InvalidArgumentError("flop_convention_invalid", f"flop_convention={flop_convention!r} is not a convention",
                                   remedy="use 'fma2' (one multiply-accumulate = 2 FLOPs) or 'fma1'",
                                   flop_convention=repr(flop_convention))
    return flop_convention


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return out


def _clip(text: str, n: int = 44) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def trace_summary(trace: "Trace", *, flop_convention: str = "fma2", by: str = "op", max_rows: int | None = None,
                  count_fma_as_two: Any = _MISSING) -> str:
    """The summary text. `by` is "op" (default), "layer" or "module"; `max_rows` elides
    the middle of a long table."""
    if count_fma_as_two is not _MISSING:
        raise InvalidArgumentError("flop_keyword_removed", "count_fma_as_two= was removed",
                                   remedy="use flop_convention='fma2' (count_fma_as_two=True) or 'fma1' (False)",
                                   keyword="count_fma_as_two")
    conv = check_convention(flop_convention)
    if by not in ("op", "layer", "module"):
        raise InvalidArgumentError("invalid_argument", f"by={by!r} is not 'op', 'layer' or 'module'",
                                   remedy="summary(by='layer') groups passes; by='module' totals each module")
    ops = list(trace)
    flops = {op.label: op_flops(op, conv) for op in ops}  # raises fma1's error up front
    have_flops = any(v is not None for v in flops.values())
    total_flops = sum(v for v in flops.values() if v is not None) if have_flops else None
    if conv == "fma2" and trace.cost.total_flops:
        total_flops = trace.cost.total_flops  # the capture's own total (a backend may know more)
    times = [op.meta.get("duration_s") for op in ops]
    have_time = any(t is not None for t in times)
    fwd = trace.cost.forward_duration or (sum(t for t in times if t is not None) if have_time else None)
    p = trace.provenance
    params = list(trace._params.values())
    n_param = sum(q.numel for q in params)
    n_train = sum(q.numel for q in params if q.trainable)

    lines = [f"Trace of {p.model_class or trace.name} ({p.backend} backend)",
             f"  ops {len(ops)} ({sum(1 for o in ops if o.kind == 'op')} compute), layers {len(trace._layers)} "
             f"({sum(1 for l in trace._layers.values() if len(l.ops) > 1)} multi-pass), modules {len(trace._modules)}",
             f"  params {fmt_count(n_param)} in {len(params)} tensors ({fmt_count(n_train)} trainable, "
             f"{fmt_bytes(trace.cost.total_param_memory or sum(q.nbytes for q in params))})",
             f"  activations {fmt_bytes(trace.cost.total_activation_memory)}, "
             f"FLOPs {fmt_count(total_flops) if total_flops is not None else 'n/a'} ({conv}), "
             f"MACs {fmt_count(trace.cost.total_macs) if trace.cost.total_macs else 'n/a'}, "
             f"time {fmt_seconds(fwd) if fwd else 'n/a'}",
             ""]

    def pnum(addrs: tuple[str, ...]) -> str:
        n = sum(trace._params[a].numel for a in addrs if a in trace._params)
        return fmt_count(n) if addrs else "-"

    def fsum(xs: list[Any]) -> Any:
        xs = [x for x in xs if x is not None]
        return sum(xs) if xs else None

    if by == "op":
        headers = ["#", "label", "func", "module", "shape", "dtype", "params", "bytes", "FLOPs", "time"]
        rows = [[str(op.index), _clip(op.label), _clip(op.func_name, 24), _clip(op.module or "-", 32),
                 fmt_shapes(op.shapes, 2), (op.dtype or "-").replace("torch.", ""), pnum(op.params),
                 fmt_bytes(op.nbytes), fmt_count(flops[op.label]), fmt_seconds(op.meta.get("duration_s"))]
                for op in ops]
        right = {0, 6, 7, 8, 9}
    elif by == "layer":
        headers = ["label", "func", "module", "passes", "shape", "params", "bytes", "FLOPs", "time"]
        rows = []
        for layer in trace._layers.values():
            shapes = {o.shape for o in layer.ops}
            rows.append([_clip(layer.label), _clip(layer.func_name, 24), _clip(layer.module or "-", 32),
                         str(len(layer.ops)), fmt_shape(layer.ops[0].shape) if len(shapes) == 1 else "varies",
                         pnum(layer.params), fmt_bytes(sum(o.nbytes for o in layer.ops)),
                         fmt_count(fsum([flops[o.label] for o in layer.ops])),
                         fmt_seconds(fsum([o.meta.get("duration_s") for o in layer.ops]))])
        right = {3, 5, 6, 7, 8}
    else:
        members: dict[str, list["Op"]] = {}
        for op in ops:
            for a in set(op.modules):
                members.setdefault(a, []).append(op)
        headers = ["module", "class", "calls", "ops", "params", "bytes", "FLOPs", "time"]
        rows = []
        for a, mod in trace._modules.items():
            mops = members.get(a, [])
            rows.append([_clip(a, 40), _clip(mod.class_name, 24), str(mod.num_calls), str(len(mops)),
                         fmt_count(mod.num_params_total), fmt_bytes(sum(o.nbytes for o in mops)),
                         fmt_count(fsum([flops[o.label] for o in mops])),
                         fmt_seconds(fsum([o.meta.get("duration_s") for o in mops]))])
        right = {2, 3, 4, 5, 6, 7}
    if max_rows is not None and len(rows) > max_rows:
        head = max_rows - max_rows // 2
        hidden = len(rows) - max_rows
        rows = rows[:head] + [["..."] + [f"({hidden} more rows)"] + [""] * (len(headers) - 2)] + rows[len(rows) - max_rows // 2:]
    lines += _table(headers, rows, right)
    return "\n".join(lines)
