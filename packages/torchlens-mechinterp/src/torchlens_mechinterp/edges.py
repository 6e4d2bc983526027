"""Edges of the component graph as interventions: `patch_edges` and `edge_scores` (EAP, EAP-IG).

patch_edges(trace, edges, *, corrupted_graph) returns a fork in which every patched receiver
reads ``input - sum(s) + sum(s_corrupt)`` over its patched edges. Receivers are patched in
topological order, one stage at a time (a layer's attention receivers, its MLP, logits); the
component graph is rebuilt on the partly patched fork before each later stage, so ``input`` and
``s`` are the values of the patched forward itself (the MIB convention; with edges into one
receiver they are the clean values). Each stage is ONE replay (`fork.do({...})`): for an
m{L} / logits receiver the edited site is its pre-norm's output, recomputed locally as
norm(patched input); for a{L}.h{H}<q|k|v> it is the projection output, where only head H's
q / k / v columns are replaced by the local recomputation norm(patched input) @ W[h] + b[h]
(all heads and roles of one projection written together).

edge_scores(model, inputs, *, corrupted_input, metric, ...) scores every edge by edge
attribution patching: ``(s_corrupt - s_clean) . dM/d(input of t)``, summed over positions and
reduced over examples. A receiver's gradient is its own: the backward stops at its read (the
pre-norm's output for m{L} / logits, head H's q / k / v columns of the projection output) and a
local pull-back through the norm (and the projection slice) carries it to the receiver's input.
method="eap_ig" averages that gradient over `steps` points e_corrupt + k/m (e_clean - e_corrupt),
k = 0..m-1 (left Riemann sum) on the input node. Implementation note (a deviation from the spec's
"one capture per evaluation point"): ONE capture of the first clean row gives the graph structure
(cached per model); the evaluation points run the live model with PyTorch forward hooks at the
modules the captured graph names (the input node's module, the pre-norms, the o- and q/k/v
projections, the MLPs, the LM head), and row 0 of the clean pass is checked against the identity
receipt (and against the capture when it came from that row). The sender values come from those
hooks: s_corrupt from EAP-IG's first point (the corrupted forward), s_clean from one extra no-grad
forward that stops once the last pre-norm input is read (the unembedding does not run).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlens.errors import MechInterpError
from torchlens_mechinterp._common import _eps, _norm_kind
from torchlens_mechinterp.graph import ComponentGraph, Edge, Receiver, component_graph

# ---------------------------------------------------------------------------------------------
# local recomputation from the captured parameters


def _norm_fn(trace: Any, address: str) -> Callable[[Any], Any]:
    """norm(x) of the norm module `address`, rebuilt from its captured kind, eps and parameters;
    `norm.vjp(x, U)` is its vector-Jacobian product for a stack of cotangents U [n, *x.shape]."""
    import torch

    call = trace._modules[address].calls[0]
    kind = _norm_kind(call)
    eps = _eps(call, kind)
    params = list(dict.fromkeys(a for o in call.ops for a in o.params))
    gamma = next((a for a in params if len(trace._params[a].shape) == 1 and a.rsplit(".", 1)[-1] == "weight"), None)
    beta = next((a for a in params if a != gamma and len(trace._params[a].shape) == 1), None)
    g = trace._params[gamma].value.detach() if gamma else None
    b = trace._params[beta].value.detach() if beta else None
    offset = 0.0
    if kind == "rms_norm":
        from torchlens_mechinterp._common import _gamma_offset

        offset = _gamma_offset(call, gamma)

    def norm(x: Any) -> Any:
        if kind == "layer_norm":
            return torch.nn.functional.layer_norm(x, (x.shape[-1],), g.to(x.dtype) if g is not None else None,
                                                  b.to(x.dtype) if b is not None else None, eps)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (g.to(x.dtype) + offset) if g is not None else y

    def vjp(x: Any, U: Any) -> Any:
        """J(x)^T u for every u of U (closed form; x [..., d], U [n, ..., d])."""
        if kind == "layer_norm":
            xc = x - x.mean(-1, keepdim=True)
            inv = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
            xhat = xc * inv
            a = U * g.to(U.dtype) if g is not None else U
            return inv * (a - a.mean(-1, keepdim=True) - xhat * (a * xhat).mean(-1, keepdim=True))
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * inv
        a = U * (g.to(U.dtype) + offset) if g is not None else U
        return inv * (a - xhat * (a * xhat).mean(-1, keepdim=True))

    def stats(x: Any) -> tuple[Any, Any]:
        """(xhat, 1/sigma) of x [..., d]: the normalised input and its inverse scale."""
        if kind == "layer_norm":
            xc = x - x.mean(-1, keepdim=True)
            inv = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
            return xc * inv, inv
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * inv, inv

    norm.vjp = vjp  # type: ignore[attr-defined]
    norm.stats = stats  # type: ignore[attr-defined]
    norm.kind = kind  # type: ignore[attr-defined]
    norm.gamma = None if g is None else g + offset  # type: ignore[attr-defined]
    norm.beta = b if kind == "layer_norm" else None  # type: ignore[attr-defined]
    return norm


@dataclass
class _Proj:
    label: str  # the projection output op the q/k/v facets read
    W: dict[str, Any]  # role -> [n_heads, d_model, d_head]
    b: dict[str, Any]  # role -> [n_heads, d_head] or None
    cols: dict[str, Any]  # role -> [n_heads, d_head] column indices


def _projections(trace: Any, attention: str, views: Any = None) -> dict[str, _Proj]:
    """Projection output op label -> its per-head q/k/v weight slices (from heads._qkv_view, or
    from `views`, the attention's HeadWeightViews the component graph already built)."""
    from torchlens_mechinterp._common import entries
    from torchlens_mechinterp.heads import _qkv_view

    out: dict[str, _Proj] = {}
    for role in ("q", "k", "v"):
        if views is not None:
            R = role.upper()
            v = {"W": getattr(views, "W_" + R), "b": getattr(views, "b_" + R)}
        else:
            v = _qkv_view(trace, attention, role, "patch_edges")
        label = entries(trace, attention)[role].spec.home
        p = out.setdefault(label, _Proj(label, {}, {}, {}))
        from torchlens_mechinterp.graph import _columns

        cols = _columns(trace, attention, role)
        p.W[role] = v["W"].detach()
        p.b[role] = v["b"].detach() if v["b"] is not None else None
        p.cols[role] = cols
    return out


# ---------------------------------------------------------------------------------------------
# patch_edges


def stage_sites(trace: Any, target: Any, graph: ComponentGraph, patched: dict[str, list[str]],
                corrupted_graph: ComponentGraph, cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """{op label: new value} that makes each receiver of `patched` (receiver -> sender names)
    read ``input - sum(s) + sum(s_corrupt)``, with input and s read from `graph`: the pre-norm
    output (m{L}, logits; an EDGE site) or the projection output with only that head's q/k/v
    columns replaced (an ACT site), recomputed locally from `trace`'s parameters. `target` is
    the trace whose current projection outputs the unpatched columns come from."""
    return _sites(trace, target, graph.receivers, patched, lambda n: graph.nodes[n].value,
                  lambda r: r.value, corrupted_graph, {} if cache is None else cache)


def _sites(trace: Any, target: Any, receivers: dict[str, Receiver], patched: dict[str, list[str]],
           value_of: Callable[[str], Any], input_of: Callable[[Receiver], Any], corrupted_graph: ComponentGraph,
           cache: dict[str, Any]) -> dict[str, Any]:
    """The vectorised body of `stage_sites`: receivers are grouped by (input op, patched sender
    set); each group's patched input is ``x + M @ (s_corrupt - s)`` over the stacked sender
    differences, normed once; the q/k/v receivers' head slices are one batched matmul."""
    import torch

    groups: dict[tuple[str, tuple[str, ...]], list[Receiver]] = {}
    for rname, senders in patched.items():
        r = receivers[rname]
        groups.setdefault((r.label, tuple(sorted(senders))), []).append(r)
    by_label: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for key in groups:
        by_label.setdefault(key[0], []).append(key)
    sites: dict[str, Any] = {}
    for keys in by_label.values():
        r0 = groups[keys[0]][0]
        x = input_of(r0).detach()
        names = list(dict.fromkeys(s for k in keys for s in k[1]))
        pos = {n: i for i, n in enumerate(names)}
        xs = x.reshape(1, -1).expand(len(keys), -1)
        if names:
            diff = torch.stack([corrupted_graph.nodes[n].value.detach().to(x.dtype).reshape(-1)
                                - value_of(n).detach().to(x.dtype).reshape(-1) for n in names])
            mask = torch.zeros(len(keys), len(names), dtype=x.dtype)
            for i, k in enumerate(keys):
                mask[i, [pos[n] for n in k[1]]] = 1
            xs = xs + mask @ diff
        if "norm:" + r0.norm not in cache:
            cache["norm:" + r0.norm] = _norm_fn(trace, r0.norm)
        normed = cache["norm:" + r0.norm](xs.reshape((len(keys),) + tuple(x.shape)))
        heads: list[tuple[int, Receiver]] = []
        for g, k in enumerate(keys):
            for r in groups[k]:
                if r.kind in ("mlp", "logits"):
                    out = trace._ops[r.norm_output].out
                    sites[r.norm_output] = normed[g].reshape(out.shape).to(out.dtype)
                else:
                    heads.append((g, r))
        if not heads:
            continue
        if "proj:" + r0.module not in cache:
            cache["proj:" + r0.module] = _projections(trace, r0.module)
        pj = cache["proj:" + r0.module]
        role_proj = {role: p for p in pj.values() for role in p.W}
        d = x.shape[-1]
        inp = normed[torch.tensor([g for g, _ in heads])].reshape(len(heads), -1, d)
        W = torch.stack([role_proj[r.kind].W[r.kind][int(r.head)] for _, r in heads]).to(x.dtype)
        vals = torch.bmm(inp, W)  # [R, B*P, d_head]
        if all(role_proj[r.kind].b[r.kind] is not None for _, r in heads):
            vals = vals + torch.stack([role_proj[r.kind].b[r.kind][int(r.head)] for _, r in heads]
                                      ).to(x.dtype).unsqueeze(1)
        else:
            for i, (_, r) in enumerate(heads):
                b = role_proj[r.kind].b[r.kind]
                if b is not None:
                    vals[i] = vals[i] + b[int(r.head)].to(x.dtype)
        by_proj: dict[str, list[int]] = {}
        for i, (_, r) in enumerate(heads):
            by_proj.setdefault(role_proj[r.kind].label, []).append(i)
        for label, idx in by_proj.items():
            if label not in sites:
                sites[label] = target._ops[label].out.detach().clone()
            new = sites[label]
            flat = new.reshape(-1, new.shape[-1])
            cols = torch.cat([role_proj[heads[i][1].kind].cols[heads[i][1].kind][int(heads[i][1].head)] for i in idx])
            flat[:, cols] = vals[idx].permute(1, 0, 2).reshape(flat.shape[0], -1).to(new.dtype)
            sites[label] = flat.reshape(new.shape)
    return sites


def _shared_norms(graph: ComponentGraph) -> dict[str, list[str]]:
    """norm address -> the blocks it feeds, for norms that feed more than one block."""
    norms: dict[str, list[str]] = {}
    for r in graph.receivers.values():
        if r.kind != "logits" and r.module not in norms.setdefault(r.norm, []):
            norms[r.norm].append(r.module)
    return {n: m for n, m in norms.items() if len(m) > 1}


def _edge_names(edges: Iterable[Any], function: str) -> list[str]:
    names = []
    for e in edges:
        n = e.name if isinstance(e, Edge) else e
        if not isinstance(n, str) or "->" not in n:
            raise MechInterpError("mi_edge_unknown", f"{function}: {e!r} is not a component-graph edge",
                                  remedy="pass edges from component_graph(trace).edges (or their names)",
                                  function=function)
        names.append(n)
    seen, twice = set(), []
    for n in names:
        if n in seen:
            twice.append(n)
        seen.add(n)
    if twice:
        raise MechInterpError("mi_edge_patch_edge_repeated", f"{function}: edges passed more than once: "
                              f"{sorted(set(twice))}", remedy="pass each edge once", function=function,
                              repeated=sorted(set(twice)))
    return names


def _graph_for(trace: Any, edges: Iterable[Any]) -> ComponentGraph:
    """The component graph of `trace`: the one the passed Edge objects belong to when it was
    built on this very trace and its values are still the trace's (every receiver value is the
    op output object the trace holds now; a `do` on the trace replaces them), else a new build."""
    graph = next((e.graph for e in edges if isinstance(e, Edge)), None)
    if graph is not None and getattr(graph, "_trace", None) is trace and all(
            trace._ops[r.label].out is r.value for r in graph.receivers.values()):
        return graph
    return component_graph(trace)


def patch_edges(trace: Any, edges: Iterable[Any], *, corrupted_graph: ComponentGraph) -> Any:
    """A fork of `trace` in which every edge of `edges` reads its sender's corrupted value."""
    import torch

    function = "patch_edges"
    edges = list(edges)
    names = _edge_names(edges, function)
    if not isinstance(corrupted_graph, ComponentGraph):
        raise MechInterpError("mi_edge_corrupted_graph_invalid", f"{function}: corrupted_graph= is a "
                              f"{type(corrupted_graph).__name__}, not a ComponentGraph", remedy="corrupted_graph="
                              "component_graph(corrupted_trace)", function=function)
    from torchlens_mechinterp.audit import require_replayable

    require_replayable(trace, function)  # mi_edge_patch_not_replayable, before anything runs
    graph = _graph_for(trace, edges)
    unknown = sorted(n for n in names if n not in graph.edges)
    if unknown:
        raise MechInterpError("mi_edge_unknown", f"{function}: {len(unknown)} edges are not in this trace's "
                              f"component graph: {unknown[:5]}", remedy="pass edges from component_graph(trace)",
                              function=function, unknown=unknown)
    missing = sorted({graph.edges[n].sender.name for n in names} - set(corrupted_graph.nodes))
    shape_ok = tuple(corrupted_graph.nodes["input"].value.shape) == tuple(graph.nodes["input"].value.shape)
    if missing or not shape_ok:
        raise MechInterpError("mi_edge_scores_inputs_mismatched", f"{function}: the corrupted graph does not match "
                              f"this trace (missing senders {missing}, same shape {shape_ok})",
                              remedy="build corrupted_graph from a capture of the same model on inputs of the same "
                              "shape", function=function, missing=missing)
    shared = _shared_norms(graph)
    hit = sorted({graph.edges[n].receiver.name for n in names if graph.edges[n].receiver.kind == "mlp"
                  and graph.edges[n].receiver.norm in shared})
    if hit:
        raise MechInterpError("mi_edge_scores_shared_norm", f"{function}: the receivers {hit} read a norm shared "
                              f"with attention {shared}: writing its output would patch the attention too",
                              remedy="use a model whose attention and MLP have their own pre-norms",
                              function=function, receivers=hit)
    by_receiver: dict[str, list[str]] = {}
    for n in names:
        e = graph.edges[n]
        by_receiver.setdefault(e.receiver.name, []).append(e.sender.name)
    fork = trace.fork()
    if not names:
        return fork
    stages = [[r.name for r in st if r.name in by_receiver] for st in graph.stages()]
    stages = [st for st in stages if st]
    cache: dict[str, Any] = {}
    values = {n: node.value for n, node in graph.nodes.items()}  # the fork's current sender values
    stale: set[str] = set()
    for i, stage in enumerate(stages):
        rs = {r: graph.receivers[r] for r in stage}
        current = graph if i == 0 else _rebuild(graph, fork, rs, values, stale)
        sites = _sites(trace, fork, current.receivers, {r: by_receiver[r] for r in stage}, values.__getitem__,
                       lambda r: r.value, corrupted_graph, cache)
        with torch.no_grad():
            fork.do(sites)
        key = graph.receivers[stage[0]].stage
        stale |= {n for n, node in graph.nodes.items() if node.kind in ("head", "mlp") and _made_at(node) >= key}
    return fork


def _made_at(node: Any) -> tuple[int, int]:
    """The stage whose patches can change `node`: its own layer's attention (heads) or MLP."""
    return (int(node.layer), 0 if node.kind == "head" else 1)


def _rebuild(graph: ComponentGraph, fork: Any, receivers: dict[str, Any], values: dict[str, Any],
             stale: set[str]) -> ComponentGraph:
    """The component graph of the partly patched `fork`, for the receivers of one stage: the
    structure is `graph`'s (patches change values, never the dataflow); the senders that earlier
    stages may have changed are re-read from the fork (heads: z @ W_O from its z facet; MLPs:
    their output op), each receiver's value is its pre-norm input op on the fork, and the
    identity receipt is checked on them before any site is computed."""
    import dataclasses

    import torch

    from torchlens_mechinterp.graph import _identity

    shape = tuple(graph.nodes["input"].value.shape)
    need = {s.name for r in receivers.values() for s in r.senders} & stale
    heads: dict[str, Any] = {}
    for n in sorted(need):
        node = graph.nodes[n]
        if node.kind == "mlp":
            values[n] = fork._ops[node.label].out.reshape(shape)
        else:
            if node.module not in heads:
                z = fork._modules[node.module].calls[0].facets["z"].value  # [B, P, H, d_head]
                W_O = graph._views[node.module].W_O
                heads[node.module] = torch.einsum("bphd,hde->bphe", z, W_O.to(z.dtype)).reshape(
                    shape[:-1] + (W_O.shape[0], W_O.shape[-1]))
            values[n] = heads[node.module][..., int(node.head), :]
        stale.discard(n)
    nodes = {n: dataclasses.replace(graph.nodes[n], value=values[n]) for n in
             dict.fromkeys(s.name for r in receivers.values() for s in r.senders)}
    inputs: dict[str, Any] = {}
    fresh = {}
    for name, r in receivers.items():
        if r.label not in inputs:
            inputs[r.label] = fork._ops[r.label].out
        fresh[name] = dataclasses.replace(r, value=inputs[r.label], senders=[nodes[s.name] for s in r.senders])
    receipt = _identity(fresh, torch)
    return ComponentGraph(nodes, fresh, {}, receipt, graph.n_layers, graph.n_heads, graph.parallel)


# ---------------------------------------------------------------------------------------------
# edge_scores


@dataclass(frozen=True)
class EdgeScore:
    score: float
    receiver: str
    sender: str


class EdgeScoreTable:
    """A scalar ReadTable of EDGE rows: ``{(target, "EDGE", (edge name,)): EdgeScore}``."""

    def __init__(self, rows: dict[str, EdgeScore], meta: dict[str, Any]) -> None:
        self._rows = rows
        self.meta = meta

    def items(self):
        return [(("model", "EDGE", (name,)), row) for name, row in self._rows.items()]

    def __getitem__(self, name: str) -> EdgeScore:
        return self._rows[name[0] if isinstance(name, tuple) else name]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def scores(self) -> dict[str, float]:
        return {n: r.score for n, r in self._rows.items()}

    def save(self, path: Any) -> Path:
        p = Path(path)
        p.write_text(json.dumps({"kind": "EDGE", "meta": self.meta, "rows": {
            n: {"score": r.score, "sender": r.sender, "receiver": r.receiver} for n, r in self._rows.items()}}))
        return p

    @classmethod
    def load(cls, path: Any) -> EdgeScoreTable:
        d = json.loads(Path(path).read_text())
        return cls({n: EdgeScore(v["score"], v["receiver"], v["sender"]) for n, v in d["rows"].items()}, d["meta"])

    def __repr__(self) -> str:
        return f"EdgeScoreTable({len(self._rows)} EDGE rows, method={self.meta.get('method')!r})"


def _setting(why: str, **fields: Any) -> MechInterpError:
    return MechInterpError("mi_edge_scores_setting_invalid", f"edge_scores: {why}", remedy="method='eap' or "
                           "'eap_ig', steps a positive int (eap: 1), example_reduction 'mean' or 'sum'",
                           function="edge_scores", **fields)


def _input_module(trace: Any, graph: ComponentGraph) -> tuple[str, str]:
    """(module address, output label) of the module whose output carries the input node's value."""
    from torchlens_mechinterp.residual import walk

    w = walk(trace, "edge_scores")
    cands = [w.base] + [h for h, _ in w.base_hops][::-1]
    for lab in cands:
        for address, mod in trace._modules.items():
            if address in ("", "self") or len(mod.calls) != 1:
                continue
            if mod.calls[0].output_labels and mod.calls[0].output_labels[0] == lab:
                return address, lab
    raise _setting(f"no module outputs the input node {w.base!r} (nor a value-preserving view of it); the "
                   "interpolation of eap_ig has nowhere to enter", base=w.base)


def edge_scores(model: Any, inputs: Any, *, corrupted_input: Any, metric: Callable[[Any], Any],
                method: str = "eap_ig", steps: int | None = None, example_reduction: str = "mean",
                ) -> EdgeScoreTable:
    """EAP / EAP-IG score of every edge of the component graph (see module doc)."""
    import torch

    import torchlens as tl

    if method not in ("eap", "eap_ig"):
        raise _setting(f"method={method!r}", method=method)
    if steps is None:
        steps = 5 if method == "eap_ig" else 1
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or (method == "eap" and steps != 1):
        raise _setting(f"steps={steps!r} for method={method!r}", steps=repr(steps))
    if example_reduction not in ("mean", "sum"):
        raise _setting(f"example_reduction={example_reduction!r}", example_reduction=repr(example_reduction))
    if not callable(metric):
        raise MechInterpError("mi_edge_scores_metric_invalid", "edge_scores: metric is not callable",
                              remedy="metric=lambda logits: logits[:, -1, a] - logits[:, -1, b]",
                              function="edge_scores")
    if not hasattr(inputs, "shape") or not hasattr(corrupted_input, "shape") \
            or tuple(inputs.shape) != tuple(corrupted_input.shape):
        raise MechInterpError("mi_edge_scores_inputs_mismatched", "edge_scores: the corrupted input's shape "
                              f"{tuple(getattr(corrupted_input, 'shape', ()))} differs from the clean input's "
                              f"{tuple(getattr(inputs, 'shape', ()))}", remedy="pad or pair the corrupted prompts "
                              "to the clean prompts' shape", function="edge_scores")
    # the graph's STRUCTURE from one capture of the first clean row (the dataflow does not depend on the
    # batch), kept per model while its parameters, buffers and the input's shape after the batch stay the same
    key = _plan_key(model, inputs)
    hit = _PLANS.get(model)
    fresh = hit is None or hit[0] != key
    if fresh:
        st = tl.trace(model, inputs[:1], save="all")
        try:
            plan = _ScorePlan(st, model)
        finally:
            try:
                st.cleanup()
            except Exception:  # noqa: BLE001 - cleanup is best-effort
                pass
        _PLANS[model] = (key, plan)
    else:
        plan = hit[1]
    return plan.run(model, inputs, corrupted_input, metric, method, steps, example_reduction, fresh, torch)


#: model -> (key, _ScorePlan): the structure of the last edge_scores call on that model
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_key(model: Any, inputs: Any) -> tuple:
    """What the cached structure depends on: the input's shape after the batch and dtype, and every
    parameter and buffer (storage, in-place version, shape, dtype), and the training flag."""
    tensors = list(model.parameters()) + list(model.buffers())
    return (tuple(inputs.shape[1:]), str(inputs.dtype), bool(getattr(model, "training", False)),
            tuple((t.data_ptr(), t._version, tuple(t.shape), str(t.dtype)) for t in tensors))


class _Stop(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a hook of a no-grad scoring pass once it has read everything it needs."""


class _ScorePlan:
    """Everything edge_scores reads from the structure capture: the component graph, the module
    of every hook point (input node, o-projections, MLPs, pre-norms, q/k/v projections, LM head)
    and the per-head weights; `run` then scores all edges from live hooked forwards."""

    def __init__(self, trace: Any, model: Any) -> None:
        import torch

        from torchlens_mechinterp._common import head_facts
        from torchlens_mechinterp.heads import _o_projection

        g = component_graph(trace)
        shared = _shared_norms(g)
        if shared:
            raise MechInterpError("mi_edge_scores_shared_norm", f"edge_scores: one norm feeds several blocks "
                                  f"{shared}: a receiver-local gradient is not defined", remedy="use a model whose "
                                  "attention and MLP have their own pre-norms (GPT-2, GPT-NeoX, Pythia)",
                                  function="edge_scores", shared={k: list(v) for k, v in shared.items()})
        self.graph = g
        self.in_module, _ = _input_module(trace, g)
        attns = list(dict.fromkeys(n.module for n in g.nodes.values() if n.kind == "head"))
        self.projs = {a: _projections(trace, a, g._views.get(a)) for a in attns}
        self.proj_module = {p.label: trace._ops[p.label].module for pj in self.projs.values() for p in pj.values()}
        for lab, mod in self.proj_module.items():
            call = trace._modules[mod].calls[0]
            if not call.output_labels or call.output_labels[0] != lab:
                raise _setting(f"the q/k/v projection output {lab!r} is not its module's output")
        self.o_module = {a: _o_projection(trace, a, "edge_scores")[4] for a in attns}
        self.W_O = {a: g._views[a].W_O.detach() for a in attns}
        self.head_address = trace._ops[head_facts(trace, "edge_scores").logits_label].module
        if not self.head_address or self.head_address == "self":
            raise _setting("the unembedding does not run inside a module of its own (no hook point)")
        # senders in graph order without the bias nodes (their scores are exactly 0); one block per receiver input
        self.senders = [n for n in g.nodes.values() if n.kind != "bias"]
        self.index = {n.name: i for i, n in enumerate(self.senders)}
        self.norms = list(dict.fromkeys(r.norm for r in g.receivers.values()))
        self.mlps = {n.module: n for n in g.nodes.values() if n.kind == "mlp"}
        self.norm_fns = {n: _norm_fn(trace, n) for n in self.norms}
        # pre-norm input label -> its receivers, ordered: the q/k/v heads of each projection output (with
        # the gathered columns and stacked transposed weights of their slices), then the m{L} / logits reader
        self.blocks: dict[str, list[Any]] = {}
        # label -> [(proj label, cols (None: all, in order), W^T [n, d_head, d], n, const [n * d_head])]
        self.gathers: dict[str, list[tuple[str, Any, Any, int, Any]]] = {}
        by_label: dict[str, list[Any]] = {}
        for r in g.receivers.values():
            by_label.setdefault(r.label, []).append(r)
        for label, rs in by_label.items():
            ordered, gathers = [], []
            heads = [r for r in rs if r.kind in ("q", "k", "v")]
            for plabel in dict.fromkeys(p.label for r in heads for p in self.projs[r.module].values()
                                        if r.kind in p.W):
                mine = [r for r in heads if next(p for p in self.projs[r.module].values() if r.kind in p.W).label
                        == plabel]
                p = next(p for p in self.projs[mine[0].module].values() if p.label == plabel)
                mine.sort(key=lambda r: int(p.cols[r.kind][int(r.head)].min()))  # column order: no gather
                cols = torch.cat([p.cols[r.kind][int(r.head)] for r in mine])
                WT = torch.stack([p.W[r.kind][int(r.head)].transpose(0, 1) for r in mine])  # [n, d_head, d]
                nf = self.norm_fns[mine[0].norm]
                if nf.gamma is not None:  # the norm's scale folded into the slices: a = gamma * (g_cols @ W^T)
                    WT = WT * nf.gamma.to(WT.dtype)
                if nf.kind == "layer_norm":  # centred over d: a - mean(a) in the same matmul
                    WT = WT - WT.mean(-1, keepdim=True)
                # xhat @ WT[h]^T from the live projection output: proj[:, cols] - (b_h + beta @ W_h)
                const = torch.cat([(p.b[r.kind][int(r.head)] if p.b[r.kind] is not None
                                    else p.W[r.kind].new_zeros(p.W[r.kind].shape[-1]))
                                   + (nf.beta.to(p.W[r.kind].dtype) @ p.W[r.kind][int(r.head)]
                                      if nf.beta is not None else 0) for r in mine])
                ident = bool(torch.equal(cols, torch.arange(len(cols), dtype=cols.dtype)))
                gathers.append((plabel, None if ident else cols, WT, len(mine), const))
                ordered += mine
            ordered += [r for r in rs if r.kind in ("mlp", "logits")]
            self.blocks[label], self.gathers[label] = ordered, gathers

    # -- one hooked forward ------------------------------------------------------------------

    def _forward(self, model: Any, x: Any, point: Any, grad: bool, torch: Any) -> dict[str, Any]:
        """Run `model(x)` with hooks; `point` (or None) replaces the input node's value. Returns
        the reads: "input", "z:<attn>" (o-projection input), "mlp:<mlp>", "norm_in:<norm>",
        "norm:<norm>" / proj labels (the receivers' reads, grad-retaining when `grad`), "logits".
        Without `grad` the pass only feeds sender values and the row-0 receipt, so it stops (a private
        exception out of the hook) as soon as every sender and every pre-norm input has been read: the
        unembedding and whatever follows the last norm never run."""
        seen: dict[str, Any] = {}
        hs = []
        need = None if grad else ({"input"} | {"z:" + a for a in self.o_module} | {"mlp:" + m for m in self.mlps}
                                  | {"norm_in:" + n for n in self.norms})

        def done() -> None:
            if need is not None and len(seen) >= len(need) and need.issubset(seen):
                raise _Stop

        def on_input(_m: Any, _a: Any, out: Any) -> Any:
            val = out if point is None else point.reshape(out.shape).to(out.dtype)
            if grad:  # a leaf, so the receivers' reads carry gradients with frozen parameters
                val = val.detach().clone().requires_grad_(True)
            seen["input"] = val
            return val

        def keep(key: str, what: str) -> Callable:
            def hook(_m: Any, args: Any, out: Any) -> None:
                if what == "norm":
                    seen["norm_in:" + key] = args[0]
                t = out[0] if isinstance(out, tuple) else out
                seen[key if what != "norm" else "norm:" + key] = t
                done()
            return hook

        def keep_z(attn: str) -> Callable:
            def hook(_m: Any, args: Any) -> None:
                seen["z:" + attn] = args[0]
                done()
            return hook

        try:
            hs.append(model.get_submodule(self.in_module).register_forward_hook(on_input))
            for a, mod in self.o_module.items():
                hs.append(model.get_submodule(mod).register_forward_pre_hook(keep_z(a)))
            for mod in self.mlps:
                hs.append(model.get_submodule(mod).register_forward_hook(keep("mlp:" + mod, "out")))
            for n in self.norms:
                hs.append(model.get_submodule(n).register_forward_hook(keep(n, "norm")))
            if grad:
                for lab, mod in self.proj_module.items():
                    hs.append(model.get_submodule(mod).register_forward_hook(keep(lab, "proj")))
            if grad:
                hs.append(model.get_submodule(self.head_address).register_forward_hook(keep("logits", "head")))
            with torch.enable_grad() if grad else torch.no_grad():
                model(x)
        except _Stop:
            pass
        finally:
            for h in hs:
                h.remove()
        return seen

    def _reads(self, seen: dict[str, Any]) -> dict[str, Any]:
        """What the scores need from one forward: the input node's value, each attention's z
        [B, P, H, d_head] and each MLP's output, detached."""
        e = seen["input"].detach()
        out = {"input": e}
        for a, W_O in self.W_O.items():
            out["z:" + a] = seen["z:" + a].detach().reshape(tuple(e.shape[:-1]) + (W_O.shape[0], W_O.shape[1]))
        for mod in self.mlps:
            out["mlp:" + mod] = seen["mlp:" + mod].detach().reshape(e.shape)
        return out

    def _sender_values(self, reads: dict[str, Any], rows: slice, torch: Any) -> dict[str, Any]:
        """Sender name -> [rows, P, d_model] (heads: z_h @ W_O[h])."""
        out = {"input": reads["input"][rows]}
        for a, W_O in self.W_O.items():
            z = reads["z:" + a][rows]
            res = torch.einsum("bphd,hde->bphe", z, W_O.to(z.dtype))
            for n in self.senders:
                if n.kind == "head" and n.module == a:
                    out[n.name] = res[..., int(n.head), :]
        for mod, n in self.mlps.items():
            out[n.name] = reads["mlp:" + mod][rows]
        return out

    def _diff(self, clean: dict[str, Any], corr: dict[str, Any], torch: Any) -> Any:
        """[senders, B*P*d] of s_corrupt - s_clean, in sender order; heads as (z_corrupt - z_clean) @ W_O[h]
        (linear in z), written straight into their rows."""
        e = clean["input"]
        dt = e.dtype
        diff = e.new_empty((len(self.senders), e.numel()))
        torch.sub(corr["input"].reshape(-1), e.reshape(-1), out=diff[self.index["input"]])
        for mod, n in self.mlps.items():
            torch.sub(corr["mlp:" + mod].to(dt).reshape(-1), clean["mlp:" + mod].to(dt).reshape(-1),
                      out=diff[self.index[n.name]])
        for a, W_O in self.W_O.items():
            dz = corr["z:" + a].to(dt) - clean["z:" + a].to(dt)
            res = torch.einsum("bphd,hde->hbpe", dz, W_O.to(dt))  # [H, B, P, d]
            for n in self.senders:
                if n.kind == "head" and n.module == a:
                    diff[self.index[n.name]].view(res.shape[1:]).copy_(res[int(n.head)])
        return diff

    def _check_row0(self, values: dict[str, Any], seen: dict[str, Any], fresh: bool, torch: Any) -> None:
        """The hooks read what the captured graph names, checked on row 0 of the clean batch: every
        receiver input read by a hook is the sum of its hooked senders (the identity receipt on the
        live values, float budget as in component_graph), and, when the structure was captured from
        this very row, each hooked value equals the capture's (float-rounding tolerant)."""
        from torchlens_mechinterp._common import dtype_eps
        from torchlens_mechinterp.graph import IDENTITY_HEADROOM

        bias = {n.name: n.value for n in self.graph.nodes.values() if n.kind == "bias"}
        for rs in self.blocks.values():
            r = rs[0]
            parts = torch.stack([(bias[s.name] if s.kind == "bias" else values[s.name])[:1].detach().double()
                                 .reshape(-1) for s in r.senders])
            v = seen["norm_in:" + r.norm][:1].detach().double().reshape(-1)
            eps = dtype_eps(seen["norm_in:" + r.norm], values["input"])
            budget = IDENTITY_HEADROOM * eps * (1 + len(r.senders)) * (parts.abs().sum(0) + v.abs())
            if bool(((parts.sum(0) - v).abs() > budget).any()):
                raise _setting(f"the live hooks for receiver {r.name!r}: its input is not the sum of its senders "
                               "(the model's forward differs from the captured structure)", receiver=r.name)
        if not fresh:
            return
        pairs = [(n.name, values[n.name][:1], n.value) for n in self.senders]
        pairs += [(r.name, seen["norm_in:" + r.norm][:1], r.value) for r in
                  (rs[0] for rs in self.blocks.values())]
        for name, got, ref in pairs:
            got, ref = got.detach().double(), ref.detach().double().reshape(got.shape)
            tol = 1e4 * dtype_eps(ref) * float(ref.abs().max().clamp_min(1e-30))
            if float((got - ref).abs().max()) > tol:
                raise _setting(f"the live hook for {name!r} does not read what the captured graph names (the model's "
                               "forward differs between the capture and the scoring passes)", node=name)

    # -- the scores ----------------------------------------------------------------------------

    def run(self, model: Any, inputs: Any, corrupted: Any, metric: Callable, method: str, steps: int,
            reduction: str, fresh: bool, torch: Any) -> EdgeScoreTable:
        g = self.graph
        grads: dict[str, Any] = {}  # pre-norm input label -> the factored receiver gradients (see _grads)
        if method == "eap":
            clean_seen = self._forward(model, inputs, None, True, torch)
            r_clean = self._reads(clean_seen)
            self._check_row0(self._sender_values(r_clean, slice(0, 1), torch), clean_seen, fresh, torch)
            r_corr = self._reads(self._forward(model, corrupted, None, False, torch))
            self._grads(clean_seen, metric, grads, torch)
        else:
            clean_seen = self._forward(model, inputs, None, False, torch)
            r_clean = self._reads(clean_seen)
            self._check_row0(self._sender_values(r_clean, slice(0, 1), torch), clean_seen, fresh, torch)
            del clean_seen
            e_clean = r_clean["input"]
            r_corr: dict[str, Any] = {}
            for k in range(steps):
                if k == 0:  # e_corrupt itself: the corrupted input's forward
                    seen = self._forward(model, corrupted, None, True, torch)
                    r_corr = self._reads(seen)
                else:
                    e_corrupt = r_corr["input"]
                    seen = self._forward(model, inputs, e_corrupt + (k / steps) * (e_clean - e_corrupt), True, torch)
                self._grads(seen, metric, grads, torch)
                del seen
        e = r_clean["input"]
        rows = self._scores(self._diff(r_clean, r_corr, torch), grads, reduction, steps, e.shape[0], e.shape[-1],
                            torch)
        meta = {"method": method, "steps": steps, "example_reduction": reduction, "n_edges": len(rows),
                "identity_receipt": g.identity_receipt["max_budget_fraction"]}
        return EdgeScoreTable(rows, meta)

    def _grads(self, seen: dict[str, Any], metric: Callable, acc: dict[str, Any], torch: Any) -> None:
        """Adds this point's receiver-local gradients to acc[pre-norm input label]: ONE backward to the
        receivers' reads (pre-norm outputs of m{L} / logits, q/k/v projection outputs), then per norm
        the closed-form pull-back J^T u = inv * (a - xhat * mean(a * xhat)), a = gamma * u (centred for
        layer_norm), u = g_cols @ W^T for a q/k/v head. Its head part is kept factored, so a point costs
        no [heads, B*P, d] tensor: "G" accumulates inv * g_cols (the a-term, mapped to d by W^T once in
        `_scores`) and "w" / "xhat" keep inv * mean(a * xhat) per head and xhat per point, where
        a . xhat = g_cols . (xhat @ W^T) = g_cols . (proj_cols - b - beta @ W) is read off the live
        projection output (no matmul). The m{L} / logits reader's pull-back goes to d directly ("m")."""
        with torch.enable_grad():
            logits = seen["logits"]
            m = metric(logits)
            B = logits.shape[0]
            if not hasattr(m, "shape") or tuple(m.shape) != (B,):
                raise MechInterpError("mi_edge_scores_metric_invalid", f"edge_scores: metric returned "
                                      f"{tuple(getattr(m, 'shape', ())) or type(m).__name__}, not one value per "
                                      f"example ({B},)", remedy="return a [batch] tensor, e.g. logits[:, -1, a] "
                                      "- logits[:, -1, b]", function="edge_scores")
            keys = list(dict.fromkeys("norm:" + rs[-1].norm for rs in self.blocks.values()
                                      if rs[-1].kind in ("mlp", "logits"))) + list(self.proj_module)
            gs = torch.autograd.grad(m.sum(), [seen[k] for k in keys], allow_unused=True)
        gmap = dict(zip(keys, gs))
        with torch.no_grad():
            for label, rs in self.blocks.items():
                nf = self.norm_fns[rs[0].norm]  # the heads' norm (a parallel block's MLP reads its own, below)
                x = seen["norm_in:" + rs[0].norm].detach()
                d = x.shape[-1]
                xf = x.reshape(-1, d)
                a = acc.setdefault(label, {"G": [None] * len(self.gathers[label]), "w": [[] for _ in
                                                                                         self.gathers[label]],
                                           "xhat": [], "m": None})
                xhat, inv = nf.stats(xf)
                if self.gathers[label]:
                    a["xhat"].append(xhat)
                for i, (plabel, cols, _WT, n, const) in enumerate(self.gathers[label]):
                    gp = gmap.get(plabel)
                    if gp is None:  # no head of this projection reaches the metric: zero at this point
                        gsel = xf.new_zeros(xf.shape[0], const.numel())
                        psel = gsel
                    else:
                        gp, pv = gp.reshape(-1, gp.shape[-1]), seen[plabel].detach().reshape(-1, gp.shape[-1])
                        gsel = gp[:, :const.numel()] if cols is None else gp[:, cols]
                        psel = pv[:, :const.numel()] if cols is None else pv[:, cols]
                        gsel, psel = gsel.to(xf.dtype), psel.to(xf.dtype)
                    c = (gsel * (psel - const.to(xf.dtype))).reshape(xf.shape[0], n, -1).sum(-1)  # [B*P, n]
                    a["w"][i].append(c.mul_(inv / d))
                    if a["G"][i] is None:
                        a["G"][i] = gsel * inv
                    else:
                        a["G"][i].addcmul_(gsel, inv)
                if rs[-1].kind in ("mlp", "logits"):
                    u = gmap.get("norm:" + rs[-1].norm)
                    if u is not None:
                        v = self.norm_fns[rs[-1].norm].vjp(xf, u.detach().reshape(-1, d).to(xf.dtype))
                        a["m"] = v if a["m"] is None else a["m"].add_(v)

    #: (row, position) pairs per chunk of the score contraction
    _CHUNK = 64

    def _scores(self, diff: Any, acc: dict[str, Any], reduction: str, steps: int, B: int, d: int,
                torch: Any) -> dict[str, EdgeScore]:
        """score(s -> r) = sum over rows and positions of (s_corrupt - s_clean) . grad_r, / B for "mean",
        / steps. Per receiver input, over chunks of (row, position) pairs (so the chunk's gradients
        stay in cache; `_CHUNK`): grad_r of its heads = G @ W^T - sum over points of w * xhat (two batched matmuls),
        the reader's row from "m", then ONE matmul [receivers, chunk*d] x [chunk*d, senders] added up."""
        dt = diff.dtype
        vals: dict[tuple[str, str], float] = {}
        with torch.no_grad():
            for label, rs in self.blocks.items():
                a = acc[label]
                gathers = self.gathers[label]
                idx = [self.index[s.name] for s in rs[0].senders if s.kind != "bias"]
                if idx == list(range(idx[0], idx[0] + len(idx))):
                    dsel = diff[idx[0]:idx[0] + len(idx)]
                else:
                    dsel = diff[idx]
                N, R = len(idx), len(rs)
                BP = diff.shape[1] // d
                dv = dsel.view(N, BP, d)
                Gs = [a["G"][i].to(dt).reshape(BP, n, WT.shape[1]).transpose(0, 1).contiguous()
                      for i, (_p, _c, WT, n, _k) in enumerate(gathers)]  # [n, B*P, d_head]
                ws = [torch.stack(a["w"][i], -1).to(dt) for i in range(len(gathers))]  # [B*P, n, K]
                xh = torch.stack(a["xhat"], 1).to(dt) if gathers else None  # [B*P, K, d]
                m = a["m"].to(dt).reshape(BP, d) if a["m"] is not None else None
                out = diff.new_zeros((R, N))
                for c0 in range(0, BP, self._CHUNK):
                    c1 = min(BP, c0 + self._CHUNK)
                    buf = diff.new_empty((R, c1 - c0, d))
                    at = 0
                    for i, (_p, _c, WT, n, _k) in enumerate(gathers):
                        torch.bmm(Gs[i][:, c0:c1], WT.to(dt), out=buf[at:at + n])
                        buf[at:at + n].sub_(torch.bmm(ws[i][c0:c1], xh[c0:c1]).transpose(0, 1))
                        at += n
                    if rs[-1].kind in ("mlp", "logits"):
                        if m is None:
                            buf[at].zero_()
                        else:
                            buf[at].copy_(m[c0:c1])
                    out.addmm_(buf.reshape(R, -1), dv[:, c0:c1].reshape(N, -1).t())
                red = (out * (1.0 / (steps * (B if reduction == "mean" else 1)))).tolist()  # [R, n_senders]
                names = [self.senders[i].name for i in idx]
                for j, r in enumerate(rs):
                    for i, sname in enumerate(names):
                        vals[(sname, r.name)] = red[j][i]
        rows: dict[str, EdgeScore] = {}
        for name, edge in self.graph.edges.items():
            score = 0.0 if edge.sender.kind == "bias" else float(vals[(edge.sender.name, edge.receiver.name)])
            rows[name] = EdgeScore(score, edge.receiver.name, edge.sender.name)
        return rows


__all__ = ["patch_edges", "edge_scores", "EdgeScoreTable", "EdgeScore"]
