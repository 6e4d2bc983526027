"""`tl.merge_ranks` / `tl.merge_report`: stitch rank-local traces at their collective boundary
ops (framework-neutral; values are compared through the backend's payload codec digests).

The derivation (`_derive`) runs on every call, for live traces and loaded paths alike:

1. each item is a `Trace` or a saved trace path (loaded with `tl.load`, which verifies it);
   its `provenance.extra["distributed"]` names its rank and run id (an armed capture);
2. every boundary op's `collective_boundary_v1` payload is checked, and where the op's values
   were saved its proof digests are recomputed from them: an artifact whose boundary record
   does not match its own values is tampered (`merge_artifact_tampered`);
3. boundary ops are grouped by correlation key (group uid, channel, sequence number) and each
   key gets an alignment verdict (`MergeAlignment`) and a value verdict (`MergeValueStatus`).

`merge_report` returns the verdicts and problems and never raises on conflicts;
`merge_ranks` raises the first problem typed, else builds the `MergedTrace` presenter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchlens.distributed.records import (
    MergeAlignment,
    MergeValueStatus,
    check_boundary,
    correlation,
    digest_encoded,
)
from torchlens.errors import ArtifactError, InvalidArgumentError, TorchLensError

_CONTRIB = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}
_SEND = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


@dataclass
class CollectiveVerdict:
    """The alignment and value verdicts of one correlation key."""

    key: tuple
    kind: str
    expected_ranks: tuple[int, ...]
    present_ranks: tuple[int, ...]
    alignment: str
    value_status: str
    ops: dict[int, str] = field(default_factory=dict)
    detail: str = ""


@dataclass
class MergeReport:
    """What `merge_report` derived: per-key verdicts and artifact-level problems."""

    ranks: tuple[int, ...]
    run_ids: dict[int, Any]
    verdicts: list[CollectiveVerdict]
    problems: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.alignment == MergeAlignment.ALIGNED
                                         and v.value_status != MergeValueStatus.CONTRADICTED for v in self.verdicts)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            out[v.alignment] = out.get(v.alignment, 0) + 1
        return out

    def summary(self) -> str:
        lines = [f"merge report: ranks {list(self.ranks)}, {len(self.verdicts)} collective keys, "
                 f"{'mergeable' if self.ok else 'NOT mergeable'}"]
        runs = sorted({str(r) for r in self.run_ids.values()})
        if len(runs) > 1:
            lines.append(f"  run ids differ: {runs}")
        for p in self.problems:
            lines.append(f"  problem {p['code']}: {p['detail']}")
        for v in self.verdicts:
            if v.alignment != MergeAlignment.ALIGNED or v.value_status == MergeValueStatus.CONTRADICTED:
                lines.append(f"  {v.kind} {v.key}: {v.alignment}/{v.value_status} {v.detail}")
        return "\n".join(lines)


@dataclass
class _Rank:
    rank: int
    world_size: int
    run_id: Any
    trace: Any
    boundaries: list[tuple[Any, dict]]


def _load(item: Any, problems: list) -> Any:
    if isinstance(item, (str, Path)):
        from torchlens.io.artifact import load_artifact

        try:
            return load_artifact(item)
        except TorchLensError as exc:
            problems.append({"code": exc.code, "detail": f"{item}: {exc}", "error": exc})
            return None
    if hasattr(item, "_ops") and hasattr(item, "provenance"):
        return item
    raise InvalidArgumentError("merge_input_invalid", f"merge got a {type(item).__name__}, not a trace or a path",
                               remedy="pass a list of rank traces or their saved .tlspec paths")


def _codec(trace: Any) -> Any:
    backend = getattr(trace, "_backend", None)
    if backend is None:
        from torchlens.backends.registry import get_protocol

        backend = get_protocol(trace.backend)
    return backend.payload_codec()


def _digests(codec: Any, values: Any) -> list[str] | None:
    out = []
    for v in values:
        if v is None or not codec.can_encode(v):
            return None
        out.append(digest_encoded(codec.encode(v)))
    return out


def _rank_of(trace: Any, problems: list) -> _Rank | None:
    info = (trace.provenance.extra or {}).get("distributed")
    if not isinstance(info, dict) or "rank" not in info:
        raise InvalidArgumentError("merge_input_invalid", "a trace given to merge was not captured under "
                                   "tl.distributed.arm() (its provenance has no distributed record)",
                                   remedy="call tl.distributed.arm() at process start on every rank, then capture")
    r = _Rank(int(info["rank"]), int(info.get("world_size", 1)), info.get("run_id"), trace, [])
    ev2op = {o.event_id: o for o in trace._ops.values()}
    codec = None
    for op in trace._ops.values():
        payload = (getattr(op, "meta", None) or {}).get("collective")
        if payload is None:
            continue
        try:
            check_boundary(payload, f"rank {r.rank} op {op.label}")
            if int(payload["rank"]) != r.rank or payload.get("run_id") != r.run_id:
                raise ArtifactError("merge_artifact_tampered", f"rank {r.rank} op {op.label}: its boundary names rank "
                                    f"{payload['rank']} / run {payload.get('run_id')}, the trace rank {r.rank} / run "
                                    f"{r.run_id}", remedy="merge the artifacts the ranks saved, unedited")
            if op.saved:
                codec = codec or _codec(trace)
                recv = op.outs if payload["geometry"]["received"] else ()
                got_r = _digests(codec, recv)
                parents = [ev2op[e].outs[s] if e in ev2op and ev2op[e].saved else None for e, s in op.parent_slots]
                got_c = _digests(codec, parents) if payload["geometry"]["contributed"] else []
                proof = payload["proof"]
                if (got_r is not None and got_r != list(proof["received_digest"])) or (
                        got_c is not None and got_c != list(proof["contributed_digest"])):
                    raise ArtifactError("merge_artifact_tampered", f"rank {r.rank} op {op.label}: its saved values do "
                                        "not match the digests its boundary record proved at capture",
                                        remedy="merge the artifacts the ranks saved, unedited; capture again",
                                        rank=r.rank, label=op.label)
        except ArtifactError as exc:
            problems.append({"code": exc.code, "detail": str(exc), "rank": r.rank, "error": exc})
            continue
        r.boundaries.append((op, payload))
    return r


def _derive(items: Any) -> tuple[MergeReport, dict[int, _Rank]]:
    if isinstance(items, (str, Path)) or not hasattr(items, "__iter__"):
        raise InvalidArgumentError("merge_input_invalid", "merge takes a list of rank traces or paths",
                                   remedy="tl.merge_ranks([trace0, trace1]) or tl.merge_ranks([path0, path1])")
    items = list(items)
    if not items:
        raise InvalidArgumentError("merge_input_invalid", "merge got an empty list", remedy="pass one trace per rank")
    problems: list[dict[str, Any]] = []
    ranks: dict[int, _Rank] = {}
    for item in items:
        trace = _load(item, problems)
        if trace is None:
            continue
        r = _rank_of(trace, problems)
        if r.rank in ranks:
            problems.append({"code": "merge_duplicate_rank", "detail": f"two traces of global rank {r.rank}",
                             "rank": r.rank})
            continue
        ranks[r.rank] = r
    run_ids = {k: r.run_id for k, r in sorted(ranks.items())}
    if len(set(map(str, run_ids.values()))) > 1:
        problems.append({"code": "merge_run_mismatch", "detail": f"the traces come from different runs: {run_ids}"})
    keyed: dict[tuple, dict[int, tuple[Any, dict]]] = {}
    for k, r in sorted(ranks.items()):
        for op, payload in r.boundaries:
            keyed.setdefault(correlation(payload), {})[k] = (op, payload)
    verdicts = [_verdict(key, members, set(ranks)) for key, members in keyed.items()]
    return MergeReport(tuple(sorted(ranks)), run_ids, verdicts, problems), ranks


def _expected(key: tuple, payload: dict) -> tuple[int, ...]:
    channel = key[1]
    if channel.startswith("p2p:"):
        src, _, dst = channel[4:].partition("->")
        return (int(src), int(dst))
    return tuple(payload["group"]["global_ranks"])


def _verdict(key: tuple, members: dict[int, tuple[Any, dict]], given: set[int]) -> CollectiveVerdict:
    first = next(iter(members.values()))[1]
    expected = _expected(key, first)
    present = tuple(sorted(members))
    kinds = {_SEND.get(p["kind"], p["kind"]) for _, p in members.values()}
    kind = first["kind"] if len(kinds) == 1 else "/".join(sorted(kinds))
    if key[1].startswith("p2p:") and kinds == {"send", "recv"}:  # named by its sending side
        kind = next(p["kind"] for _, p in members.values() if p["geometry"]["role"] == "sender")
    v = CollectiveVerdict(key, kind, expected, present, MergeAlignment.ALIGNED, MergeValueStatus.UNPROVEN,
                          {k: op.label for k, (op, _) in members.items()})
    missing = [k for k in expected if k not in members]
    if len({p.get("run_id") for _, p in members.values()}) > 1:
        v.alignment, v.detail = MergeAlignment.RUN_MISMATCH, "members come from different runs"
        return v
    if missing:
        why = [f"rank {k} {'not given' if k not in given else 'has no matching op'}" for k in missing]
        v.alignment, v.detail = MergeAlignment.MISSING_PEER, "; ".join(why)
        return v
    if key[1].startswith("p2p:"):
        if kinds != {"send", "recv"}:
            v.alignment, v.detail = MergeAlignment.KIND_MISMATCH, f"a message channel holds {sorted(kinds)}"
            return v
    elif len(kinds) != 1:
        v.alignment, v.detail = MergeAlignment.KIND_MISMATCH, f"members ran {sorted(kinds)} under one key"
        return v
    geo = {k: p["geometry"] for k, (_, p) in members.items()}
    proof = {k: p["proof"] for k, (_, p) in members.items()}
    if len({str(g.get("reduce_op")) for g in geo.values()}) > 1:
        v.alignment, v.detail = MergeAlignment.GEOMETRY_MISMATCH, "reduce ops differ"
        return v
    bad = _geometry_problem(kind, geo, expected, members)
    if bad:
        v.alignment, v.detail = MergeAlignment.GEOMETRY_MISMATCH, bad
        return v
    v.value_status, why = _values(kind, geo, proof, expected, members)
    if why:
        v.detail = why
    return v


def _geometry_problem(kind: str, geo: dict, expected: tuple, members: dict) -> str:
    def sig(items: list) -> list:
        return [(tuple(i["shape"]), i["dtype"]) for i in items]

    if kind in ("send", "isend", "recv", "irecv"):
        sent = [sig(g["contributed"]) for g in geo.values() if g["role"] == "sender"]
        got = [sig(g["received"]) for g in geo.values() if g["role"] == "receiver"]
        return "" if sent and got and sent[0] == got[0] else f"sent {sent} but received {got}"
    if kind == "broadcast":
        roots = [k for k, g in geo.items() if g["role"] == "root"]
        if len(roots) != 1:
            return f"{len(roots)} broadcast roots"
        want = sig(geo[roots[0]]["contributed"])
        return "" if all(sig(g["received"]) == want for g in geo.values() if g["role"] == "receiver") else \
            "receivers' shapes differ from the root's"
    contrib = {str(sig(g["contributed"])) for g in geo.values()}
    if kind != "reduce_scatter" and len(contrib) > 1:
        return f"contributions differ in shape/dtype: {sorted(contrib)}"
    if kind == "all_gather" and any(len(g["received"]) != len(expected) for g in geo.values()):
        return "an all_gather received a list of the wrong length"
    return ""


def _values(kind: str, geo: dict, proof: dict, expected: tuple, members: dict) -> tuple[str, str]:
    if kind in ("all_reduce", "all_gather", "all_gather_into_tensor"):
        got = {tuple(p["received_digest"]) for p in proof.values()}
        if len(got) != 1:
            return MergeValueStatus.CONTRADICTED, "ranks received different values"
        if kind == "all_gather":
            order = sorted(members, key=lambda k: members[k][1]["group_rank"])
            want = tuple(proof[k]["contributed_digest"][0] for k in order)
            if next(iter(got)) != want:
                return MergeValueStatus.CONTRADICTED, "the gathered list is not the members' contributions in order"
        return MergeValueStatus.PROVEN, ""
    if kind in ("send", "isend", "recv", "irecv", "broadcast"):
        src = [k for k, g in geo.items() if g["role"] in ("sender", "root")][0]
        sent = proof[src]["contributed_digest"][0]
        for k, g in geo.items():
            if g["role"] == "receiver" and proof[k]["received_digest"][0] != sent:
                return MergeValueStatus.CONTRADICTED, f"rank {k} received other bytes than rank {src} sent"
        return MergeValueStatus.PROVEN, ""
    return MergeValueStatus.UNPROVEN, "a reduce-scatter's chunks are not compared bitwise"


def merge_report(items: Any) -> MergeReport:
    """The graph-free merge diagnostic: alignment and value verdicts per correlation key and
    the artifact-level problems (tampering, duplicate ranks, different runs). Never raises on
    conflicts (only on input that is not a list of traces or paths)."""
    report, _ = _derive(items)
    return report


def merge_ranks(items: Any) -> "MergedTrace":
    """Stitch rank-local traces into one `MergedTrace` at their collective boundaries; any
    problem or unaligned key refuses typed (see `merge_report` for the full list)."""
    report, ranks = _derive(items)
    for p in report.problems:
        err = p.get("error")
        if err is not None:
            raise err
        raise ArtifactError(p["code"], p["detail"], remedy="merge one trace per rank, all from one run "
                            "(tl.merge_report(...) lists every problem)")
    for v in report.verdicts:
        if v.alignment == MergeAlignment.MISSING_PEER:
            raise ArtifactError("merge_boundary_unmatched", f"{v.kind} {v.key}: {v.detail}",
                                remedy="give merge_ranks every member rank's trace of the same run",
                                missing=[k for k in v.expected_ranks if k not in v.present_ranks])
        if v.alignment == MergeAlignment.RUN_MISMATCH:
            raise ArtifactError("merge_run_mismatch", f"{v.kind} {v.key}: {v.detail}",
                                remedy="merge traces of one run")
        if v.alignment != MergeAlignment.ALIGNED or v.value_status == MergeValueStatus.CONTRADICTED:
            raise ArtifactError("merge_boundary_mismatch", f"{v.kind} {v.key}: {v.alignment}/{v.value_status}: "
                                f"{v.detail}", remedy="tl.merge_report(...) shows every verdict",
                                alignment=v.alignment, value_status=v.value_status)
    return MergedTrace(report, ranks)


@dataclass
class MergedCollective:
    """One collective joined across ranks: the per-rank boundary op labels and the roles."""

    kind: str
    key: tuple
    ops: dict[int, str]
    contributing_ranks: tuple[int, ...]
    receiving_ranks: tuple[int, ...]
    value_status: str


class MergedTrace:
    """N rank-local traces joined at their collective boundary ops (a presenter over the rank
    traces, not a Trace). Nodes are `(rank, op label)`; edges are each rank's own data edges
    plus the cross-rank edges the collectives carry (`kind="collective"`)."""

    def __init__(self, report: MergeReport, ranks: dict[int, Any]) -> None:
        self.report = report
        self.traces: dict[int, Any] = {k: r.trace for k, r in sorted(ranks.items())}
        self.run_id = next(iter(report.run_ids.values()), None)
        self.nodes: list[tuple[int, str]] = []
        self.edges: list[tuple[tuple[int, str], tuple[int, str], str]] = []
        self.collectives: list[MergedCollective] = []
        self._parents: dict[tuple[int, str], list[tuple[int, str]]] = {}
        for k, t in self.traces.items():
            ev2label = {o.event_id: o.label for o in t._ops.values()}
            for op in t._ops.values():
                node = (k, op.label)
                self.nodes.append(node)
                for eid, _slot in op.parent_slots:
                    self._edge((k, ev2label[eid]), node, "local")
        for v in report.verdicts:
            self._join(v, ranks)

    def _edge(self, a: tuple[int, str], b: tuple[int, str], kind: str) -> None:
        self.edges.append((a, b, kind))
        self._parents.setdefault(b, []).append(a)

    def _join(self, v: CollectiveVerdict, ranks: dict[int, Any]) -> None:
        roles = {k: ranks[k].trace._ops[label].meta["collective"]["geometry"]["role"] for k, label in v.ops.items()}
        senders = tuple(sorted(k for k, r in roles.items() if r in ("contributor_receiver", "sender", "root")))
        receivers = tuple(sorted(k for k, r in roles.items() if r in ("contributor_receiver", "receiver")))
        self.collectives.append(MergedCollective(v.kind, v.key, dict(v.ops), senders, receivers, v.value_status))
        for s in senders:
            src_op = ranks[s].trace._ops[v.ops[s]]
            if roles[s] == "contributor_receiver":
                ev2label = {o.event_id: o.label for o in ranks[s].trace._ops.values()}
                sources = [(s, ev2label[e]) for e, _ in src_op.parent_slots]
            else:
                sources = [(s, src_op.label)]
            for r in receivers:
                if r == s:
                    continue
                for a in sources:
                    self._edge(a, (r, v.ops[r]), "collective")

    # queries -----------------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.traces)

    @property
    def num_ops(self) -> int:
        return len(self.nodes)

    def trace(self, rank: int) -> Any:
        return self.traces[rank]

    def collective_edges(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return [(a, b) for a, b, k in self.edges if k == "collective"]

    def ancestors(self, node: tuple[int, str]) -> set[tuple[int, str]]:
        seen: set = set()
        todo = deque([node])
        while todo:
            for p in self._parents.get(todo.popleft(), ()):
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def path(self, src: tuple[int, str], dst: tuple[int, str]) -> list[tuple[int, str]] | None:
        """A shortest path of nodes from `src` to `dst` along the merged edges, or None."""
        back: dict = {dst: None}
        todo = deque([dst])
        while todo:
            n = todo.popleft()
            if n == src:
                out = [n]
                while back[out[-1]] is not None:
                    out.append(back[out[-1]])
                return out
            for p in self._parents.get(n, ()):
                if p not in back:
                    back[p] = n
                    todo.append(p)
        return None

    def inputs(self) -> list[tuple[int, str]]:
        return [(k, o.label) for k, t in self.traces.items() for o in t._ops.values() if o.kind == "input"]

    def output_nodes(self) -> list[tuple[int, str]]:
        return [(k, o.label) for k, t in self.traces.items() for o in t._ops.values() if o.kind == "output"]

    @property
    def outputs(self) -> dict[int, list[Any]]:
        """Each rank's output values, by rank."""
        return {k: [o.outs[0] for o in t._ops.values() if o.kind == "output"] for k, t in self.traces.items()}

    @property
    def output(self) -> Any:
        """The whole computation's output: the output of the ranks whose outputs depend on the
        most ranks; replicated outputs (tensor parallel) must agree bit for bit."""
        span = {}
        for k in self.traces:
            reach: set[int] = set()
            for node in self.output_nodes():
                if node[0] == k:
                    reach |= {a[0] for a in self.ancestors(node)} | {k}
            span[k] = len(reach)
        best = max(span.values())
        cands = [k for k, n in span.items() if n == best and self.outputs[k]]
        if not cands:
            raise InvalidArgumentError("merge_output_ambiguous", "no rank returned an output",
                                       remedy="read merged.outputs")
        vals = {k: self.outputs[k] for k in cands}
        codec = _codec(self.traces[cands[0]])
        digests = {k: tuple(_digests(codec, v) or ()) for k, v in vals.items()}
        if len(set(digests.values())) > 1:
            raise InvalidArgumentError("merge_output_ambiguous", f"ranks {cands} all depend on every rank but "
                                       "returned different outputs", remedy="read merged.outputs[rank]",
                                       ranks=cands)
        v = vals[cands[0]]
        return v[0] if len(v) == 1 else tuple(v)

    # drawing -----------------------------------------------------------------------------
    def to_dot(self) -> str:
        """Graphviz DOT text: one cluster per rank, collective edges bold across clusters."""
        def nid(n: tuple[int, str]) -> str:
            return f'"r{n[0]}:{n[1]}"'

        lines = ["digraph merged_trace {", "  rankdir=TB; compound=true; node [shape=box, fontsize=10];"]
        boundary = {(k, label) for c in self.collectives for k, label in c.ops.items()}
        for k, t in self.traces.items():
            lines.append(f'  subgraph cluster_rank{k} {{ label="rank {k}"; style=rounded;')
            for o in t._ops.values():
                extra = ', style=filled, fillcolor="#ffe0b0"' if (k, o.label) in boundary else ""
                lines.append(f'    {nid((k, o.label))} [label="{o.label}\\n{o.func_name}"{extra}];')
            lines.append("  }")
        for a, b, kind in self.edges:
            style = ' [style=bold, color="#c0392b", constraint=false]' if kind == "collective" else ""
            lines.append(f"  {nid(a)} -> {nid(b)}{style};")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def draw(self, path: Any = None) -> str:
        """The DOT text (`to_dot`); written to `path` when given."""
        text = self.to_dot()
        if path is not None:
            Path(path).write_text(text)
        return text

    def __repr__(self) -> str:
        return (f"MergedTrace(ranks={list(self.ranks)}, ops={self.num_ops}, collectives={len(self.collectives)}, "
                f"run_id={self.run_id!r})")


__all__ = ["merge_ranks", "merge_report", "MergedTrace", "MergeReport", "MergedCollective", "CollectiveVerdict"]
