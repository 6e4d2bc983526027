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
k = 0..m-1 (left Riemann sum) on the input node. Implementation note: the evaluation points run
the live model with PyTorch forward hooks at the modules the captured graph names (the input
node's module, the pre-norms, the q/k/v projections, the LM head); the sender values come from
two captures (clean, corrupted) through `component_graph`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchlens.errors import MechInterpError
from torchlens_mechinterp._common import _eps, _norm_kind
from torchlens_mechinterp.graph import ComponentGraph, Edge, component_graph

# ---------------------------------------------------------------------------------------------
# local recomputation from the captured parameters


def _norm_fn(trace: Any, address: str) -> Callable[[Any], Any]:
    """norm(x) of the norm module `address`, rebuilt from its captured kind, eps and parameters."""
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

    return norm


@dataclass
class _Proj:
    label: str  # the projection output op the q/k/v facets read
    W: dict[str, Any]  # role -> [n_heads, d_model, d_head]
    b: dict[str, Any]  # role -> [n_heads, d_head] or None
    cols: dict[str, Any]  # role -> [n_heads, d_head] column indices


def _projections(trace: Any, attention: str) -> dict[str, _Proj]:
    """Projection output op label -> its per-head q/k/v weight slices (from heads._qkv_view)."""
    from torchlens_mechinterp._common import entries
    from torchlens_mechinterp.heads import _qkv_view

    out: dict[str, _Proj] = {}
    for role in ("q", "k", "v"):
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
    cache = {} if cache is None else cache
    sites: dict[str, Any] = {}
    for rname, senders in patched.items():
        r = graph.receivers[rname]
        x = r.value.detach()
        for s in senders:
            x = x - graph.nodes[s].value.detach() + corrupted_graph.nodes[s].value.detach().to(x.dtype)
        if "norm:" + r.norm not in cache:
            cache["norm:" + r.norm] = _norm_fn(trace, r.norm)
        norm = cache["norm:" + r.norm]
        if r.kind in ("mlp", "logits"):
            out = trace._ops[r.norm_output].out
            sites[r.norm_output] = norm(x).reshape(out.shape).to(out.dtype)
            continue
        if "proj:" + r.module not in cache:
            cache["proj:" + r.module] = _projections(trace, r.module)
        pj = cache["proj:" + r.module]
        p = next(p for p in pj.values() if r.kind in p.W)
        if p.label not in sites:
            sites[p.label] = target._ops[p.label].out.detach().clone()
        new = sites[p.label]
        h, role = int(r.head), r.kind
        val = norm(x) @ p.W[role][h].to(x.dtype)
        if p.b[role] is not None:
            val = val + p.b[role][h].to(x.dtype)
        cols = p.cols[role][h]
        new[..., cols] = val.reshape(new[..., cols].shape).to(new.dtype)
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


def _replayable(trace: Any) -> bool:
    opts = getattr(trace, "capture_options", None) or getattr(trace, "_capture_options", None)
    val = getattr(opts, "replayable", None)
    return bool(val) if val is not None else True


def patch_edges(trace: Any, edges: Iterable[Any], *, corrupted_graph: ComponentGraph) -> Any:
    """A fork of `trace` in which every edge of `edges` reads its sender's corrupted value."""
    import torch

    function = "patch_edges"
    names = _edge_names(edges, function)
    if not isinstance(corrupted_graph, ComponentGraph):
        raise MechInterpError("mi_edge_corrupted_graph_invalid", f"{function}: corrupted_graph= is a "
                              f"{type(corrupted_graph).__name__}, not a ComponentGraph", remedy="corrupted_graph="
                              "component_graph(corrupted_trace)", function=function)
    if not _replayable(trace):
        raise MechInterpError("mi_edge_patch_not_replayable", f"{function}: the trace was not captured with "
                              "replayable=True", remedy="tl.trace(model, x, capture=tl.options.CaptureOptions("
                              "replayable=True), save='all')", function=function)
    graph = component_graph(trace)
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
    current = graph
    for i, stage in enumerate(stages):
        if i > 0:
            current = component_graph(fork, _views=graph._views)
        sites = stage_sites(trace, fork, current, {r: by_receiver[r] for r in stage}, corrupted_graph, cache)
        with torch.no_grad():
            fork.do(sites)
    return fork


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
    clean_t = tl.trace(model, inputs, save="all")
    corrupt_t = tl.trace(model, corrupted_input, save="all")
    try:
        gc = component_graph(clean_t)
        gk = component_graph(corrupt_t)
        shared = _shared_norms(gc)
        if shared:
            raise MechInterpError("mi_edge_scores_shared_norm", f"edge_scores: one norm feeds several blocks "
                                  f"{shared}: a receiver-local gradient is not defined", remedy="use a model whose "
                                  "attention and MLP have their own pre-norms (GPT-2, GPT-NeoX, Pythia)",
                                  function="edge_scores", shared={k: list(v) for k, v in shared.items()})
        in_module, _ = _input_module(clean_t, gc)
        projs = {a: _projections(clean_t, a) for a in {r.module for r in gc.receivers.values()
                                                       if r.kind in ("q", "k", "v")}}
        proj_module = {p.label: clean_t._ops[p.label].module for pj in projs.values() for p in pj.values()}
        for lab, mod in proj_module.items():
            call = clean_t._modules[mod].calls[0]
            if not call.output_labels or call.output_labels[0] != lab:
                raise _setting(f"the q/k/v projection output {lab!r} is not its module's output")
        from torchlens_mechinterp._common import head_facts

        head_address = clean_t._ops[head_facts(clean_t, "edge_scores").logits_label].module
        if not head_address or head_address == "self":
            raise _setting("the unembedding does not run inside a module of its own (no hook point)")
        e_clean = gc.nodes["input"].value.detach()
        e_corrupt = gk.nodes["input"].value.detach()
        grads = _receiver_grads(model, inputs, gc, projs, proj_module, in_module, head_address, metric, e_clean,
                                e_corrupt, steps, method, torch)
        rows: dict[str, EdgeScore] = {}
        B = e_clean.shape[0]
        for name, e in gc.edges.items():
            if e.sender.kind == "bias":
                score = 0.0
            else:
                diff = gk.nodes[e.sender.name].value.detach() - e.sender.value.detach()
                per = (diff.to(grads[e.receiver.name].dtype) * grads[e.receiver.name]).reshape(B, -1).sum(-1)
                score = float(per.mean() if example_reduction == "mean" else per.sum())
            rows[name] = EdgeScore(score, e.receiver.name, e.sender.name)
        meta = {"method": method, "steps": steps, "example_reduction": example_reduction, "n_edges": len(rows),
                "identity_receipt": gc.identity_receipt["max_budget_fraction"]}
        return EdgeScoreTable(rows, meta)
    finally:
        for t in (clean_t, corrupt_t):
            try:
                t.cleanup()
            except Exception:  # noqa: BLE001 - cleanup is best-effort
                pass


def _receiver_grads(model: Any, inputs: Any, graph: ComponentGraph, projs: dict[str, dict[str, _Proj]],
                    proj_module: dict[str, str], in_module: str, head_address: str, metric: Callable, e_clean: Any, e_corrupt: Any, steps: int,
                    method: str, torch: Any) -> dict[str, Any]:
    """receiver name -> dM/d(receiver input), receiver-local, averaged over the evaluation points."""
    recv = list(graph.receivers.values())
    norm_mods = {r.norm for r in recv}
    proj_labels = list(proj_module)
    acc: dict[str, Any] = {}
    for k in range(steps):
        alpha = 1.0 if method == "eap" else k / steps
        point = e_corrupt + alpha * (e_clean - e_corrupt)
        seen: dict[str, Any] = {}
        handles = []

        def put_input(_m: Any, _a: Any, out: Any, point: Any = point) -> Any:
            # a leaf, so the receivers' reads carry gradients even with frozen parameters
            return point.reshape(out.shape).to(out.dtype).clone().requires_grad_(True)

        def keep(name: str, what: str, seen: dict[str, Any] = seen) -> Callable:
            def hook(_m: Any, args: Any, out: Any) -> None:
                if what == "norm":
                    seen[name + ":in"] = args[0]
                t = out[0] if isinstance(out, tuple) else out
                t.retain_grad()
                seen[name] = t
            return hook

        try:
            if True:  # eap: the clean input node itself (alpha = 1)
                handles.append(model.get_submodule(in_module).register_forward_hook(put_input))
            for n in norm_mods:
                handles.append(model.get_submodule(n).register_forward_hook(keep(n, "norm")))
            for lab, mod in proj_module.items():
                handles.append(model.get_submodule(mod).register_forward_hook(keep(lab, "proj")))
            handles.append(model.get_submodule(head_address).register_forward_hook(keep("logits", "head")))
            with torch.enable_grad():
                model(inputs)
                logits = seen["logits"]
                m = metric(logits)
                B = logits.shape[0]
                if not hasattr(m, "shape") or tuple(m.shape) != (B,):
                    raise MechInterpError("mi_edge_scores_metric_invalid", f"edge_scores: metric returned "
                                          f"{tuple(getattr(m, 'shape', ())) or type(m).__name__}, not one value per "
                                          f"example ({B},)", remedy="return a [batch] tensor, e.g. logits[:, -1, a] "
                                          "- logits[:, -1, b]", function="edge_scores")
                keys = list(norm_mods) + proj_labels
                gs = torch.autograd.grad(m.sum(), [seen[n] for n in keys], allow_unused=True)
                pulled = _pullback(model, graph, projs, seen, dict(zip(keys, gs)), torch)
        finally:
            for h in handles:
                h.remove()
        for name, g in pulled.items():
            acc[name] = g if name not in acc else acc[name] + g
    return {n: g / steps for n, g in acc.items()}


def _pullback(model: Any, graph: ComponentGraph, projs: dict[str, dict[str, _Proj]], seen: dict[str, Any],
              gmap: dict[str, Any], torch: Any) -> dict[str, Any]:
    """Local pull-back of each receiver's own read gradient to its input (norm input)."""
    out: dict[str, Any] = {}
    by_norm: dict[str, list[tuple[str, Any]]] = {}
    for r in graph.receivers.values():
        g_read = gmap.get(r.norm)
        if r.kind in ("mlp", "logits"):
            u = g_read if g_read is not None else torch.zeros_like(seen[r.norm])
            by_norm.setdefault(r.norm, []).append((r.name, u.detach()))
            continue
        p = next(p for p in projs[r.module].values() if r.kind in p.W)
        g = gmap.get(p.label)
        x = seen[r.norm + ":in"]
        if g is None:
            u = torch.zeros_like(x)
        else:
            cols = p.cols[r.kind][int(r.head)]
            gs = g[..., cols]  # [B, P, d_head]
            u = gs @ p.W[r.kind][int(r.head)].to(gs.dtype).transpose(0, 1)  # [B, P, d_model]
        by_norm.setdefault(r.norm, []).append((r.name, u.detach()))
    # one vjp per norm for all its receivers: the norm applied to a stacked copy of its input
    for norm, items in by_norm.items():
        x = seen[norm + ":in"].detach()
        xs = x.unsqueeze(0).expand(len(items), *x.shape).clone().requires_grad_(True)
        mod = model.get_submodule(norm)
        with torch.enable_grad():
            y = mod(xs)
            cot = torch.stack([u.reshape(x.shape[:-1] + (u.shape[-1],)).to(y.dtype) for _, u in items])
            (gx,) = torch.autograd.grad(y, xs, cot)
        for (name, _), g in zip(items, gx):
            out[name] = g.detach()
    return out


__all__ = ["patch_edges", "edge_scores", "EdgeScoreTable", "EdgeScore"]
