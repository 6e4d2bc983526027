"""`direct_logit_contributions(trace, answer=..., vs=...)`: direct logit contributions (DLA).

DLA linearly decomposes the ACTUAL logits at the actual operating point; it is not a set of
counterfactuals. The residual stack's literal writers (``residual_decomposition``) are pushed
through the final norm with its scale FROZEN at the captured input (LayerNorm's centring is
linear and applied per row; the 1/sigma or 1/rms scale is the one the forward used), then
projected on the requested unembedding DIRECTIONS only (memory scales with the requested
tokens, never the vocabulary). One constant row carries the final norm's beta and the
unembedding bias (writer-side biases are already inside the literal writers).

Every call checks the identity ``sum(rows) + constant == the captured native logit`` against a
PER-ELEMENT budget (``per_element_cancellation_aware_v2``): each element's accumulated
|addend| basis (rows, constant and native logit projected with absolute values on the
UN-differenced answer and vs directions) x (1 + log2(n_rows + 2)) x 4 ULP headroom x the
machine epsilon of the coarsest floating dtype in the chain (float32 floor). A failure refuses
``mi_dla_identity_failed`` naming the worst element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError

from torchlens_mechinterp._common import HeadFacts, attention_addresses, dtype_eps, head_facts
from torchlens_mechinterp.stack import ComponentStack, StackRow

FUNCTION = "direct_logit_contributions"
BUDGET_MODEL = "per_element_cancellation_aware_v2"
ULP_HEADROOM = 4.0


@dataclass
class DirectLogitContributions:
    """`names` (one per row, in stack order), `values` float64 ``[n_rows, batch, K]`` (or
    ``[n_rows, batch, pos, K]`` with ``position=None``), `constant` (the ONE constant row: final
    norm beta + unembedding bias, reported apart as `constant_row`), `native` (the captured
    logits, differenced like the rows), `identity_receipt`, and the arguments."""

    names: list[str]
    values: Any
    constant: Any
    native: Any
    identity_receipt: dict[str, Any]
    answer: tuple  # token ids: shared (a flat tuple) or one tuple per batch row
    vs: tuple | None
    position: int | None
    grain: str
    components: list[str] = field(default_factory=list)
    constant_row: str = "constant"
    stack: ComponentStack | None = None

    def __getitem__(self, name: str) -> Any:
        if name == self.constant_row:
            return self.constant
        return self.values[self.names.index(name)]

    def total(self) -> Any:
        return self.values.sum(0) + self.constant

    def summary(self, batch: int = 0, k: int = 0) -> str:
        head = f"DLA[{self.grain}] answer={self.answer}" + (f" vs={self.vs}" if self.vs else "")
        lines = [head + f"  (max_budget_fraction {self.identity_receipt['max_budget_fraction']:.3g})"]
        vals = self.values[(slice(None), batch, Ellipsis, k)]  # the last position when position=None
        for name, v in zip(self.names, vals):
            lines.append(f"  {name:<44} {float(v.reshape(-1)[-1]):+.5f}")
        c = self.constant[(batch,) + ((Ellipsis, k))]
        lines.append(f"  {self.constant_row:<44} {float(c.reshape(-1)[-1]):+.5f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<DirectLogitContributions {self.grain}: {len(self.names)} rows x answer {self.answer}"
                f"{'' if self.vs is None else f' vs {self.vs}'}>")


def _tokens(value: Any, name: str, vocab: int, batch: int) -> tuple[Any, bool]:
    """(token ids as a long tensor [batch, K], per_row): an int or a flat list of ints is shared
    by every batch row; a nested list (or a 2-D tensor) of ``batch`` rows gives each row its own."""
    import numbers

    import torch

    def refuse(why: str) -> MechInterpError:
        return MechInterpError("mi_dla_token_invalid", f"{name}={value!r}: {why}", remedy=f"pass {name}= as an int "
                               f"token id, a list of them (shared by every row), or one list per batch row "
                               f"({batch} rows), in 0..{vocab - 1}", argument=name, vocab=vocab)

    v = value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) else value
    per_row = isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(r, (list, tuple)) for r in v)
    rows = [list(r) for r in v] if per_row else [[v]] if not isinstance(v, (list, tuple)) else [list(v)]
    flat = [i for r in rows for i in r]
    if not flat or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in flat):
        raise refuse("not a token id, a non-empty list of them, or one list per batch row")
    if any(not 0 <= int(i) < vocab for i in flat):
        raise refuse(f"a token id is outside the vocabulary 0..{vocab - 1}")
    if per_row and (len(rows) != batch or len({len(r) for r in rows}) != 1):
        raise refuse(f"per-row tokens need {batch} rows of equal length")
    idx = torch.tensor(rows, dtype=torch.long)
    return (idx if per_row else idx.expand(batch, idx.shape[1])), per_row


def _as_given(idx: Any, per_row: bool) -> tuple:
    return tuple(tuple(int(i) for i in r) for r in idx.tolist()) if per_row else tuple(int(i) for i in idx[0].tolist())


def _vocab(trace: Any, facts: HeadFacts) -> int:
    shape = tuple(trace._params[facts.unembed_weight].shape)
    return shape[0] if facts.weight_layout == "out_in" else shape[1]


def _directions(trace: Any, facts: HeadFacts, idx: Any) -> tuple[Any, Any]:
    """(U [B, K, d_model], bias [B, K] or None) in float64 for token ids idx [B, K], gathered:
    never the whole vocabulary."""
    W = trace._params[facts.unembed_weight].value
    flat = idx.reshape(-1)
    U = W.index_select(0, flat) if facts.weight_layout == "out_in" else W.index_select(1, flat).t()
    U = U.detach().double().reshape(idx.shape + (U.shape[-1],))
    b = trace._params[facts.unembed_bias].value if facts.unembed_bias else None
    return U, (b.index_select(0, flat).detach().double().reshape(idx.shape) if b is not None else None)


def _norm_scale(x: Any, kind: str, eps: float) -> Any:
    """The final norm's per-position scale at the captured input, frozen: 1/sqrt(var + eps)
    (LayerNorm) or 1/sqrt(mean(x^2) + eps) (RMSNorm), float64, shape [..., 1]."""
    if kind == "layer_norm":
        c = x - x.mean(-1, keepdim=True)
        return (c.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def dla_sites(trace: Any, grain: str = "layer") -> list[str]:
    from torchlens_mechinterp.heads import head_contribution_sites
    from torchlens_mechinterp.residual import walk

    facts = head_facts(trace, FUNCTION)
    w = walk(trace, FUNCTION)
    labels = w.payload_labels() + w.part_labels() + [facts.norm_input, facts.norm_output, facts.logits_label]
    if grain == "head":
        for a in sorted(attention_addresses(trace)):
            labels += head_contribution_sites(trace, a)
    return list(dict.fromkeys(labels))


def _select(v: Any, shape: tuple[int, ...], position: int | None) -> Any:
    v = v.detach().double().expand(shape) if tuple(v.shape) != shape else v.detach().double()
    return v if position is None else v[:, position:position + 1] if position >= 0 else \
        v[:, position:(position + 1) or None]


def _expand_rows(trace: Any, stack: ComponentStack, grain: str) -> list[StackRow]:
    """Layer grain: the stack's rows, a parallel block's writer split into its branches.
    Head grain: additionally each attention writer split into its query heads + output bias."""
    from torchlens_mechinterp._common import component_of, mlp_addresses
    from torchlens_mechinterp.heads import head_rows

    attn, mlp = attention_addresses(trace), mlp_addresses(trace)
    ops = trace._ops
    rows: list[StackRow] = []
    for r in stack.rows:
        if r.parts:
            for p in r.parts:
                mod, kind = component_of(ops[p].module, r.module, attn, mlp)
                rows.append(StackRow(name=mod or p, kind="writer", value=ops[p].out, label=p, site=ops[p].site,
                                     module=mod, component=kind))
        else:
            rows.append(r)
    if grain != "head":
        return rows
    out: list[StackRow] = []
    for r in rows:
        if r.component == "attn" and r.module in attn:
            heads, writer, _ = head_rows(trace, r.module, FUNCTION)
            if writer != r.label:
                raise MechInterpError("mi_head_result_unverified", f"{FUNCTION}: the residual writer {r.label!r} of "
                                      f"{r.module!r} is not its output projection's output {writer!r}",
                                      remedy="use grain='layer'", attention=r.module)
            out.extend(heads)
        else:
            out.append(r)
    return out


def direct_logit_contributions(trace: Any, answer: Any, vs: Any = None, *, grain: str = "layer",
                               position: int | None = -1, stack: ComponentStack | None = None,
                               rows: Any = None) -> DirectLogitContributions:
    """Per-component contributions to the logit of `answer` (minus `vs` when given) at
    `position` (None: every position), verified by the identity on every call.

    `answer` / `vs`: an int or a list of K ints shared by every batch row, or one list per
    batch row (``[[io_0], [io_1], ...]``, as an indirect-object logit difference needs).

    `grain`: ``"layer"`` (the residual stack's writers) or ``"head"`` (attention writers split
    into query heads + a proven output_bias row). `stack`: a verified ComponentStack to use
    instead of ``residual_decomposition(trace)``. `rows`: component names to keep; the others
    fold into one exact ``other_components`` row (a partial table)."""
    import torch

    from torchlens_mechinterp.residual import residual_decomposition
    from torchlens_mechinterp.retention import require_payloads

    if grain not in ("layer", "head"):
        raise MechInterpError("mi_dla_grain_invalid", f"grain={grain!r}", remedy="grain='layer' or grain='head'",
                              grain=str(grain))
    facts = head_facts(trace, FUNCTION)
    vocab = _vocab(trace, facts)
    batch = trace._ops[facts.norm_input].shape[0]
    answer_i, per_row = _tokens(answer, "answer", vocab, batch)
    vs_i, vs_rows = _tokens(vs, "vs", vocab, batch) if vs is not None else (None, False)
    if vs_i is not None and vs_i.shape[1] != answer_i.shape[1]:
        if vs_i.shape[1] == 1:
            vs_i = vs_i.expand(batch, answer_i.shape[1])
        else:
            raise MechInterpError("mi_dla_token_invalid", f"vs has {vs_i.shape[1]} tokens per row, answer "
                                  f"{answer_i.shape[1]}", remedy="pass one vs token, or one per answer token",
                                  argument="vs", vocab=vocab)
    seq = trace._ops[facts.norm_input].shape[-2]
    if position is not None and (isinstance(position, bool) or not isinstance(position, int)
                                 or not -seq <= position < seq):
        raise MechInterpError("mi_position_invalid", f"position={position!r} for a sequence of {seq}",
                              remedy=f"an int in {-seq}..{seq - 1}, or None for every position", position=str(position))
    if stack is not None and stack.diagnostic_only:
        raise MechInterpError("mi_stack_diagnostic_only", f"{FUNCTION} refuses a diagnostic-only stack "
                              "(strict=False, with an unresolved_remainder row)", remedy="pass a stack from "
                              "residual_decomposition(trace) (strict=True)", grade=stack.grade)
    require_payloads(trace, dla_sites(trace, grain), function=FUNCTION)
    if stack is not None:
        target = trace._ops[facts.norm_input].out
        try:
            same = stack.target_label == facts.norm_input and bool(torch.equal(stack.total(), target))
        except RuntimeError:  # shapes that do not broadcast
            same = False
        if not same:
            raise MechInterpError("mi_stack_mismatch", f"{FUNCTION}: stack= (-> {stack.target_label!r}) does not sum "
                                  f"to this trace's final-norm input {facts.norm_input!r}", remedy="pass "
                                  "residual_decomposition(trace) of this trace, or omit stack=",
                                  target=facts.norm_input, stack_target=stack.target_label)
    stack = stack if stack is not None else residual_decomposition(trace, strict=True)
    comp = _expand_rows(trace, stack, grain)

    ops = trace._ops
    x_cap = ops[facts.norm_input].out
    shape = tuple(x_cap.shape)
    x = _select(x_cap, shape, position)  # [B, P', d]
    s = _norm_scale(x, facts.norm_kind, facts.eps)
    gamma = trace._params[facts.gamma].value.detach().double() if facts.gamma else torch.ones(shape[-1]).double()
    gamma = gamma + facts.gamma_offset  # (1 + weight) norms: the offset is read from the graph
    beta = trace._params[facts.beta].value.detach().double() if facts.beta else None
    Ua, ba = _directions(trace, facts, answer_i)
    Uv, bv = _directions(trace, facts, vs_i) if vs_i is not None else (None, None)
    D = Ua - Uv if Uv is not None else Ua  # [B, K, d]
    absU = Ua.abs() + (Uv.abs() if Uv is not None else 0)

    def on(y: Any, U: Any) -> Any:  # [B, P', d] x [B, K, d] -> [B, P', K]
        return torch.einsum("bpd,bkd->bpk", y, U)

    def project(v: Any) -> tuple[Any, Any]:
        r = _select(v, shape, position)
        if facts.norm_kind == "layer_norm":
            r = r - r.mean(-1, keepdim=True)
        return on(r * s * gamma, D), on(r.abs() * s * gamma.abs(), absU)

    values, bases = [], []
    for r in comp:
        val, basis = project(r.value)
        values.append(val)
        bases.append(basis)
    names = [r.name for r in comp]
    components = [r.component for r in comp]
    if rows is not None:
        keep = [rows] if isinstance(rows, str) else list(rows)
        unknown = [k for k in keep if k not in names]
        if unknown:
            raise MechInterpError("mi_dla_rows_invalid", f"rows= names unknown components {unknown}",
                                  remedy=f"row names at grain={grain!r}: {names}", unknown=unknown)
        kept = [i for i, n in enumerate(names) if n in keep]
        other = [i for i in range(len(names)) if i not in kept]
        if other:
            names = [names[i] for i in kept] + ["other_components"]
            components = [components[i] for i in kept] + ["other"]
            values = [values[i] for i in kept] + [sum(values[i] for i in other)]
            bases = [bases[i] for i in kept] + [sum(bases[i] for i in other)]
    const = torch.zeros_like(values[0])
    cbasis = torch.zeros_like(values[0])
    if beta is not None:
        const = const + torch.einsum("d,bkd->bk", beta, D)[:, None]
        cbasis = cbasis + torch.einsum("d,bkd->bk", beta.abs(), absU)[:, None]
    if ba is not None:
        const = const + (ba - bv if bv is not None else ba)[:, None]
        cbasis = cbasis + (ba.abs() + (bv.abs() if bv is not None else 0))[:, None]
    logits = ops[facts.logits_label].out
    lshape = tuple(logits.shape)

    def gather(idx: Any) -> Any:  # the requested logits only: [B, P', K]
        g = torch.gather(logits, -1, idx[:, None, :].expand(lshape[:-1] + (idx.shape[1],)))
        return _select(g, tuple(g.shape), position)

    la = gather(answer_i)
    lv = gather(vs_i) if vs_i is not None else None
    native = la - lv if lv is not None else la
    y_cap = _select(ops[facts.norm_output].out, tuple(ops[facts.norm_output].shape), position)
    nbasis = la.abs() + (lv.abs() if lv is not None else 0) + on(y_cap, absU)
    V = torch.stack(values)
    total = V.sum(0) + const
    residual = (total - native).abs()
    eps = dtype_eps(x_cap, logits, trace._params[facts.unembed_weight].value)
    n_addends = len(values) + 2
    depth = 1 + math.log2(n_addends)
    basis = torch.stack(bases).sum(0) + cbasis + nbasis
    budget = ULP_HEADROOM * depth * eps * basis
    frac = residual / budget.clamp_min(torch.finfo(torch.float64).tiny)
    flat = int(frac.reshape(-1).argmax())
    worst_idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), frac.shape))
    worst = {"batch": worst_idx[0], "position": (position if position is not None else worst_idx[1]),
             "answer": int(answer_i[worst_idx[0], worst_idx[-1]]),
             "vs": int(vs_i[worst_idx[0], worst_idx[-1]]) if vs_i is not None else None,
             "residual": float(residual.reshape(-1)[flat]), "budget": float(budget.reshape(-1)[flat])}
    max_frac = float(frac.reshape(-1)[flat])
    receipt = {"budget_model": BUDGET_MODEL, "verified": max_frac <= 1.0, "max_abs_residual": float(residual.max()),
               "tolerance": float(budget.reshape(-1)[flat]), "max_budget_fraction": max_frac, "budget_eps": eps,
               "n_addends": n_addends, "ulp_headroom": ULP_HEADROOM, "depth_term": depth, "worst_element": worst,
               "norm": {"kind": facts.norm_kind, "eps": facts.eps, "address": facts.norm_address,
                        "input": facts.norm_input, "scale": "frozen at the captured input",
                        "gamma_offset": facts.gamma_offset},
               "native_logits": facts.logits_label, "stack_grade": stack.grade, "grain": grain}
    if max_frac > 1.0 or not math.isfinite(max_frac):
        raise MechInterpError("mi_dla_identity_failed", f"{FUNCTION}: sum(rows) + constant misses the captured logit "
                              f"at {worst} by {worst['residual']:.3g} (budget {worst['budget']:.3g}, fraction "
                              f"{max_frac:.3g})", remedy="the decomposition does not reproduce this model's head "
                              "(an unusual final norm, e.g. a (1 + weight) RMSNorm); report the model",
                              worst_element=worst, max_budget_fraction=max_frac)
    if position is not None:
        V, const, native = V[:, :, 0], const[:, 0], native[:, 0]
    return DirectLogitContributions(names=names, values=V, constant=const, native=native, identity_receipt=receipt,
                                    answer=_as_given(answer_i, per_row),
                                    vs=_as_given(vs_i, vs_rows) if vs_i is not None else None,
                                    position=position, grain=grain, components=components,
                                    stack=stack)


__all__ = ["direct_logit_contributions", "DirectLogitContributions", "dla_sites", "BUDGET_MODEL"]
