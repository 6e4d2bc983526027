"""`component_graph(trace)`: the circuit-discovery graph of a pre-norm additive-residual LM.

Nodes are the residual writers: ``input`` (the embedding sum, the base of the residual walk),
``a{L}.h{H}`` (head H's output without the attention output bias: the validated ``result``
facet), ``b{L}`` (layer L's attention output bias, broadcast to the stream's shape) and
``m{L}`` (MLP L's output, bias included). Receivers are the residual readers:
``a{L}.h{H}<q|k|v>``, ``m{L}`` and ``logits``; a receiver's value is the tensor entering its
pre-norm (never the norm's output).

Which receivers read which writers comes from the captured dataflow: a writer is a sender of a
receiver when the writer's output op is an ancestor of the receiver's pre-norm input (so on a
parallel-block model MLP L receives no edge from layer L's heads). Before returning, the
builder checks for EVERY receiver that the sum of its senders' values equals its value
(``graph.identity_receipt``); a stream that is not additive this way refuses
``mi_edge_graph_nonadditive``; grouped-query attention refuses ``mi_edge_graph_gqa_unsupported``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError
from torchlens.select.selectors import Selector
from torchlens_mechinterp._common import (
    LINEAR_FUNCS,
    VALUE_PRESERVING,
    Ancestry,
    _norm_kind,
    attention_addresses,
    component_of,
    dtype_eps,
    head_facts,
    mlp_addresses,
)

FUNCTION = "component_graph"
#: ULP headroom of the identity receipt's per-element budget
IDENTITY_HEADROOM = 64.0


@dataclass(eq=False)
class Node:
    """A residual writer. `value` is its contribution per batch row and position [B, P, d_model]."""

    name: str
    kind: str  # "input" | "head" | "bias" | "mlp"
    value: Any
    layer: int | None = None
    head: int | None = None
    module: str | None = None
    label: str | None = None  # the op whose ancestry places the writer in the dataflow

    def __repr__(self) -> str:
        return f"Node({self.name!r}, kind={self.kind!r})"


@dataclass(eq=False)
class Receiver:
    """A residual reader: `value` is the tensor entering its pre-norm."""

    name: str
    kind: str  # "q" | "k" | "v" | "mlp" | "logits"
    value: Any
    senders: list[Node]
    label: str  # the pre-norm input op
    norm: str  # the pre-norm module address
    norm_output: str  # the pre-norm's output op
    layer: int | None = None
    head: int | None = None
    module: str | None = None  # the attention / MLP / head module the receiver feeds
    projection: str | None = None  # q/k/v: the projection module whose output slice the head reads
    columns: Any = None  # q/k/v: that head's column indices in the projection output [d_head]

    @property
    def stage(self) -> tuple[int, int]:
        """Topological stage: (layer, 0) attention, (layer, 1) MLP, (inf, 2) logits."""
        if self.kind == "logits":
            return (1 << 30, 2)
        return (int(self.layer), 0 if self.kind in ("q", "k", "v") else 1)

    def __repr__(self) -> str:
        return f"Receiver({self.name!r}, senders={len(self.senders)})"


@dataclass(eq=False)
class Edge(Selector):
    """sender -> receiver; its contribution is the sender's value.

    An Edge is an intervention site for ``trace.do``: an edge into m{L} / logits names the
    receiver's pre-norm output (``selection_kind == "EDGE"``: edge substitution, the
    receiver alone reads the edited value), an edge into a{L}.h{H}<q|k|v> names that layer's
    projection output (``"ACT"``: the value written changes only head H's q / k / v columns).
    ``edge.patch_value(corrupted_graph)`` is the value that patches this edge alone:
    ``trace.do(edge, edge.patch_value(corrupted_graph))``."""

    name: str
    sender: Node
    receiver: Receiver
    graph: Any = field(default=None, repr=False)

    @property
    def contribution(self) -> Any:
        return self.sender.value

    @property
    def selection_kind(self) -> str:
        return "EDGE" if self.receiver.kind in ("mlp", "logits") else "ACT"

    @property
    def site_label(self) -> str:
        """The op label this edge's intervention writes."""
        if self.selection_kind == "EDGE":
            return self.receiver.norm_output
        from torchlens_mechinterp._common import entries

        return entries(self.graph._trace, self.receiver.module)[self.receiver.kind].spec.home

    def match_set(self, trace: Any) -> set[str]:
        return {self.site_label}

    def patch_value(self, corrupted_graph: ComponentGraph) -> Any:
        """The full site value that makes this edge alone read its corrupted sender."""
        from torchlens_mechinterp.edges import stage_sites

        g = self.graph
        return stage_sites(g._trace, g._trace, g, {self.receiver.name: [self.sender.name]},
                           corrupted_graph)[self.site_label]

    def __repr__(self) -> str:
        return f"Edge({self.name!r})"


@dataclass(eq=False)
class ComponentGraph:
    nodes: dict[str, Node]
    receivers: dict[str, Receiver]
    edges: dict[str, Edge]
    identity_receipt: dict[str, Any] = field(default_factory=dict)
    n_layers: int = 0
    n_heads: int = 0
    parallel: bool = False

    @property
    def vocabulary_edge_count(self) -> int:
        """Edges whose sender is not a bias node (the MIB vocabulary count)."""
        return sum(1 for e in self.edges.values() if e.sender.kind != "bias")

    def stages(self) -> list[list[Receiver]]:
        """Receivers grouped by topological stage (a layer's attention, its MLP, logits)."""
        out: dict[tuple[int, int], list[Receiver]] = {}
        for r in self.receivers.values():
            out.setdefault(r.stage, []).append(r)
        return [out[k] for k in sorted(out)]

    def __repr__(self) -> str:
        return (f"ComponentGraph({len(self.nodes)} nodes, {len(self.receivers)} receivers, {len(self.edges)} edges, "
                f"identity max_budget_fraction={self.identity_receipt.get('max_budget_fraction')})")


def _nonadditive(why: str, **fields: Any) -> MechInterpError:
    return MechInterpError("mi_edge_graph_nonadditive", f"{FUNCTION}: {why}", remedy="component_graph needs a "
                           "pre-norm additive residual stream whose writers are the embedding, attention heads and "
                           "MLPs (capture with save='all' and eager attention)", function=FUNCTION, **fields)


def _pre_norm(trace: Any, module: str) -> tuple[str, str, str]:
    """(norm address, norm input op, norm output op) of the norm whose output `module` reads."""
    mod = trace._modules[module]
    call = mod.calls[0]
    ops = trace._ops
    if not call.input_labels:
        raise _nonadditive(f"{module!r} has no captured tensor input", module=module)
    cur = ops[call.input_labels[0]]
    while True:
        nmod = trace._modules.get(cur.module) if cur.module else None
        ncall = next((c for c in nmod.calls if cur.label in c.op_labels), None) if nmod is not None else None
        if ncall is not None and nmod.address != module and not nmod.address.startswith(module + ".") \
                and _norm_kind(ncall) is not None and cur.label in ncall.output_labels and ncall.input_labels \
                and not any(o.func_name in LINEAR_FUNCS or o.func_name == "embedding" for o in ncall.ops):
            return nmod.address, ncall.input_labels[0], cur.label
        if cur.func_name in VALUE_PRESERVING and len(cur.parents) == 1:
            cur = ops[cur.parents[0]]
            continue
        raise _nonadditive(f"the input of {module!r} does not come from a norm module (not pre-norm)", module=module)


def _writers(trace: Any) -> tuple[Any, list[tuple[str, str, str]]]:
    """(walk, [(part label, component address, kind 'attn'|'mlp')] in forward order)."""
    from torchlens_mechinterp.residual import walk

    w = walk(trace, FUNCTION)
    if w.rescaled_at is not None:
        op = trace._ops[w.rescaled_at]
        raise _nonadditive(f"the residual stream is rescaled or mixed at {w.rescaled_at!r} ({op.func_name})",
                           label=w.rescaled_at)
    if w.constants:
        raise _nonadditive(f"parameters are added to the stream at {sorted(w.constants)}: not a head, MLP or "
                           "embedding writer", labels=sorted(w.constants))
    attn, mlp = attention_addresses(trace), mlp_addresses(trace)
    out = []
    for s in w.steps:
        for part in w.writer_parts[s.writer_label]:
            address, kind = component_of(trace._ops[part].module, trace._ops[s.label].module, attn, mlp)
            if kind not in ("attn", "mlp"):
                raise _nonadditive(f"the stream writer {part!r} (module {trace._ops[part].module!r}) is not an "
                                   "attention block or an MLP", label=part, module=trace._ops[part].module)
            out.append((part, address, kind))
    return w, out


def graph_sites(trace: Any, _writers_of: tuple[Any, Any] | None = None) -> list[str]:
    """The op labels whose payloads component_graph reads (for retention_plan). `_writers_of`
    (private): `_writers(trace)` when the caller already has it."""
    from torchlens_mechinterp.heads import head_contribution_sites

    w, writers = _writers_of if _writers_of is not None else _writers(trace)
    out = [w.base] + [h for h, _ in w.base_hops] + [p for p, _, _ in writers]
    for _, address, kind in writers:
        out += [_pre_norm(trace, address)[1]]
        if kind == "attn":
            out += head_contribution_sites(trace, address)
    out.append(head_facts(trace, FUNCTION).norm_input)
    return list(dict.fromkeys(out))


def component_graph(trace: Any, *, _views: dict[str, Any] | None = None) -> ComponentGraph:
    """The component graph of `trace` (see module doc). Reads payloads; mutates nothing.

    `_views` (private, patch_edges): head weight views already verified on the unpatched trace,
    reused on a fork whose projection outputs were written (where re-verifying them against the
    projection's input would fail by design)."""
    import torch

    from torchlens_mechinterp._common import entries
    from torchlens_mechinterp.heads import head_rows, head_weight_views
    from torchlens_mechinterp.retention import require_payloads

    structure: dict[Any, Any] = _views.setdefault("__structure__", {}) if _views is not None else {}
    w, writers = _writers(trace)
    ops = trace._ops
    attn_order = [a for _, a, k in writers if k == "attn"]
    mlp_order = [a for _, a, k in writers if k == "mlp"]
    if len(set(attn_order)) != len(attn_order) or len(set(mlp_order)) != len(mlp_order):
        raise _nonadditive("a block writes the stream more than once (looped blocks are not supported)")
    views = {}
    for a in attn_order:
        v = _views[a] if _views is not None and a in _views else head_weight_views(trace, a)
        if v.n_kv_heads != v.n_heads:
            raise MechInterpError("mi_edge_graph_gqa_unsupported", f"{FUNCTION}: {a!r} uses grouped-query attention "
                                  f"({v.n_heads} query heads, {v.n_kv_heads} key/value heads); the edge graph's "
                                  "k/v receivers are per query head", remedy="use a multi-head-attention model "
                                  "(GPT-2, GPT-NeoX, Pythia)", function=FUNCTION, attention=a,
                                  n_heads=v.n_heads, n_kv_heads=v.n_kv_heads)
        views[a] = v
    hf = head_facts(trace, FUNCTION)
    pre = {a: _pre_norm(trace, a) for a in attn_order + mlp_order}
    base = w.base
    require_payloads(trace, graph_sites(trace, (w, writers)), function=FUNCTION)
    anc = Ancestry(trace)
    nodes: dict[str, Node] = {}
    ref = ops[hf.norm_input].out
    base_value = ops[base].out
    if tuple(base_value.shape) != tuple(ref.shape):
        base_value = base_value.reshape(ref.shape)
    nodes["input"] = Node("input", "input", base_value, module=ops[base].module, label=base)
    placed: list[tuple[str, list[Node]]] = [(base, [nodes["input"]])]
    for part, address, kind in writers:
        if kind == "attn":
            L = attn_order.index(address)
            rows, _, _ = head_rows(trace, address, FUNCTION, views=views[address])
            group = []
            for h in range(views[address].n_heads):
                group.append(Node(f"a{L}.h{h}", "head", rows[h].value, L, h, address, part))
            if views[address].b_O is not None:
                group.append(Node(f"b{L}", "bias", views[address].b_O.expand(ref.shape), L, None, address, part))
        else:
            L = mlp_order.index(address)
            group = [Node(f"m{L}", "mlp", ops[part].out.reshape(ref.shape), L, None, address, part)]
        for n in group:
            nodes[n.name] = n
        placed.append((part, group))

    def senders_of(label: str) -> list[Node]:
        up = anc.of(label) | {label}
        return [n for lab, group in placed if lab in up for n in group]

    receivers: dict[str, Receiver] = {}
    for L, a in enumerate(attn_order):
        norm, nin, nout = pre[a]
        key = ("qkv", a)
        if key not in structure:  # structure only: shared by the rebuilds of patch_edges
            # the projection module of each role (the views above resolved and checked these homes)
            structure[key] = {r: (ops[entries(trace, a)[r].spec.home].module, _columns(trace, a, r))
                              for r in ("q", "k", "v")}
        cols = structure[key]
        snd = senders_of(nin)
        for h in range(views[a].n_heads):
            for r in ("q", "k", "v"):
                receivers[f"a{L}.h{h}<{r}>"] = Receiver(
                    f"a{L}.h{h}<{r}>", r, ops[nin].out, snd, nin, norm, nout, L, h, a,
                    cols[r][0], cols[r][1][h])
    for L, a in enumerate(mlp_order):
        norm, nin, nout = pre[a]
        receivers[f"m{L}"] = Receiver(f"m{L}", "mlp", ops[nin].out, senders_of(nin), nin, norm, nout, L, None, a)
    receivers["logits"] = Receiver("logits", "logits", ops[hf.norm_input].out, senders_of(hf.norm_input),
                                   hf.norm_input, hf.norm_address, hf.norm_output, None, None, hf.head_address)
    # order receivers topologically (a layer's attention, its MLP, logits)
    receivers = dict(sorted(receivers.items(), key=lambda kv: kv[1].stage))
    receipt = _identity(receivers, torch)
    edges = {}
    for r in receivers.values():
        for s in r.senders:
            edges[f"{s.name}->{r.name}"] = Edge(f"{s.name}->{r.name}", s, r, None)
    parallel = any(
        not any(n.kind == "head" and n.layer == r.layer for n in r.senders) for r in receivers.values()
        if r.kind == "mlp")
    out = ComponentGraph(nodes, receivers, edges, receipt, len(attn_order),
                         max((v.n_heads for v in views.values()), default=0), parallel)
    views["__structure__"] = structure
    out._views = views
    out._trace = trace
    for e in edges.values():
        e.graph = out
    return out


def _columns(trace: Any, attention: str, role: str) -> dict[int, Any]:
    """{head: column indices of the projection output} of role q/k/v (from the captured graph)."""
    import torch

    from torchlens_mechinterp._common import entries

    spec = entries(trace, attention)[role].spec
    home = trace._ops[spec.home]
    idx = torch.arange(int(home.shape[-1])).expand(tuple(home.shape))
    for p in spec.chain:
        idx = p.apply(idx)
    cols = idx.reshape(-1, idx.shape[-2], idx.shape[-1])[0]
    return {h: cols[h].clone() for h in range(cols.shape[0])}  # head -> [d_head] column indices


def _identity(receivers: dict[str, Receiver], torch: Any) -> dict[str, Any]:
    """Check sum(senders) == value for every receiver, with a per-element float budget. The
    senders' values are stacked once (float64) and each distinct receiver value sums its rows."""
    worst, per = 0.0, {}
    done: dict[int, float] = {}
    stack: dict[int, int] = {}
    values: list[Any] = []
    for r in receivers.values():
        for s in r.senders:
            if id(s) not in stack:
                stack[id(s)] = len(values)
                values.append(s)
    if values:
        shape = tuple(values[0].value.shape)
        allv = torch.stack([s.value.detach().reshape(shape).double() for s in values])
        alla = allv.abs()
    for r in receivers.values():
        key = id(r.value)
        if key in done:
            per[r.name] = done[key]
            continue
        idx = torch.tensor([stack[id(s)] for s in r.senders], dtype=torch.long)
        value = r.value.detach().double().reshape(shape)
        total = allv.index_select(0, idx).sum(0)
        basis = alla.index_select(0, idx).sum(0) + value.abs()
        eps = dtype_eps(r.value, *[s.value for s in r.senders])
        budget = IDENTITY_HEADROOM * eps * (1 + len(r.senders)) * basis
        frac = float(((total - value).abs() / budget.clamp_min(1e-300)).max())
        done[key] = per[r.name] = frac
        worst = max(worst, frac)
        if frac > 1:
            raise _nonadditive(f"the receiver {r.name!r} ({r.label!r}) is not the sum of its "
                               f"{len(r.senders)} senders (max budget fraction {frac:.3g})", receiver=r.name,
                               label=r.label, max_budget_fraction=frac)
    return {"oracle": "sum(senders) == receiver value (per-element float budget)", "max_budget_fraction": worst,
            "per_receiver": per, "n_receivers": len(receivers), "headroom": IDENTITY_HEADROOM}


__all__ = ["component_graph", "ComponentGraph", "Node", "Receiver", "Edge", "graph_sites"]
