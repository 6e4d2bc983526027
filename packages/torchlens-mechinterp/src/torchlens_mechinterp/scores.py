"""`head_scores`: the head taxonomy (previous-token, duplicate-token, induction heads) read
from a trace's attention patterns.

The masks and the score follow TransformerLens's head detector conventions (credited: the
`detect_head` detection patterns and its "mul" error measure), written here from their
definitions: for each batch row and head, score = sum(pattern * mask) / sum(pattern) over
[query, key], optionally with the BOS column and the current-token diagonal zeroed first,
then the mean over batch rows.

- "previous_token": query i on key i - 1.
- "duplicate_token": query i on every earlier key j < i holding the same token.
- "induction": query i on key j (1 <= j <= i) when the token before j equals token i.
- `FixedPeriodInduction(period=n)`: the fixed repeat of a sequence with period n (the
  `[bos] + R + R` probe): query i on the ONE key i - n + 1, counted only when token i
  equals token i - n; the score is the mean attention on that key over the counted
  queries (so a token that repeats inside R adds nothing). Reported as kind "induction"
  with the period in the provenance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError
from torchlens_mechinterp import _sites

KINDS = ("previous_token", "duplicate_token", "induction")


class FixedPeriodInduction:
    """Induction scored on a fixed repeat with period `period` (see the module docstring)."""

    __slots__ = ("period",)

    def __init__(self, period: int) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise MechInterpError("mi_period_invalid", f"FixedPeriodInduction(period={period!r}): the period must be a "
                                  "positive int", remedy="pass the length of the repeated block, e.g. period=50",
                                  period=repr(period))
        self.period = period

    def __repr__(self) -> str:
        return f"FixedPeriodInduction(period={self.period})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FixedPeriodInduction) and other.period == self.period

    def __hash__(self) -> int:
        return hash(("FixedPeriodInduction", self.period))


@dataclass(frozen=True)
class HeadScores:
    """Scores [layer, head] (float64 tensor) of one head-taxonomy kind, with provenance."""

    scores: Any
    kind: str
    layers: tuple[str, ...]
    provenance: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.scores.shape)

    def __getitem__(self, key: Any) -> Any:
        return self.scores[key]

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k highest-scoring heads as (layer, head, score), best first (ties by position)."""
        flat = self.scores.reshape(-1)
        n_heads = self.scores.shape[1]
        order = sorted(range(flat.numel()), key=lambda i: (-float(flat[i]), i))[:k]
        return [(i // n_heads, i % n_heads, float(flat[i])) for i in order]

    def to_numpy(self) -> Any:
        return self.scores.detach().cpu().numpy()

    def __repr__(self) -> str:
        best = ", ".join(f"{layer}.{head}={score:.3f}" for layer, head, score in self.top(3))
        return f"<HeadScores {self.kind} {tuple(self.scores.shape)}: top {best}>"


def _masks(kind: Any, tokens: Any) -> tuple[Any, Any]:
    """(mask [batch, q, k] float64, per-row count of counted queries or None)."""
    import torch

    b, n = tokens.shape
    pos = torch.arange(n)
    q, k = pos[:, None], pos[None, :]
    same = tokens[:, :, None] == tokens[:, None, :]  # [b, i, j]: token i == token j
    if isinstance(kind, FixedPeriodInduction):
        p = kind.period
        mask = torch.zeros(b, n, n, dtype=torch.float64)
        counted = torch.zeros(b, dtype=torch.float64)
        for i in range(p, n):
            hit = (tokens[:, i] == tokens[:, i - p]).to(torch.float64)
            mask[:, i, i - p + 1] = hit
            counted += hit
        return mask, counted
    if kind == "previous_token":
        return (k == q - 1).expand(b, n, n).to(torch.float64), None
    if kind == "duplicate_token":
        return (same & (k < q)).to(torch.float64), None
    # induction: the token before key j equals query token i, key j - 1 strictly before i
    before = torch.zeros(b, n, n, dtype=torch.bool)
    before[:, :, 1:] = same[:, :, :-1]
    return (before & (k >= 1) & (k - 1 < q)).to(torch.float64), None


def head_scores(trace: Any, kind: Any = "induction", *, tokens: Any = None, exclude_bos: bool = False,
                exclude_current_token: bool = False) -> HeadScores:
    """Score every attention head of `trace` for `kind` ("previous_token", "duplicate_token",
    "induction" or a `FixedPeriodInduction`). `tokens` defaults to the trace's integer input."""
    import torch

    if not (isinstance(kind, FixedPeriodInduction) or (isinstance(kind, str) and kind in KINDS)):
        raise MechInterpError("mi_head_scores_kind_unknown", f"head_scores: unknown kind {kind!r}",
                              remedy=f"use one of {', '.join(KINDS)} or FixedPeriodInduction(period=n)", kind=repr(kind))
    if not isinstance(exclude_bos, bool) or not isinstance(exclude_current_token, bool):
        raise MechInterpError("mi_head_scores_setting_invalid", "head_scores: exclude_bos and exclude_current_token "
                              "take bools", remedy="pass True or False")
    if isinstance(kind, FixedPeriodInduction) and (exclude_bos or exclude_current_token):
        raise MechInterpError("mi_head_scores_setting_invalid", "head_scores: a FixedPeriodInduction score reads one "
                              "key per query; exclude_bos/exclude_current_token do not apply",
                              remedy="drop the exclusions, or use kind='induction'")
    calls = _sites.attention_calls(trace)
    if not calls:
        raise MechInterpError("mi_no_attention", "head_scores: no attention module call in this trace",
                              remedy="trace a model whose attention an attention recipe describes (tl.facets.coverage "
                              "lists what matched)", function="head_scores")
    token_label = _sites.token_input_label(trace) if tokens is None else None
    specs = _sites.facet_specs(trace, calls, "pattern", function="head_scores",
                               extra=(token_label,) if token_label else ())
    if tokens is None:
        tokens = _sites.input_tokens(trace)
        source = "trace_input"
        if tokens is None:
            raise MechInterpError("mi_tokens_unavailable", "head_scores: the trace has no saved integer token input",
                                  remedy="pass tokens=<[batch, pos] token ids>", function="head_scores")
    else:
        source = "argument"
        tokens = torch.as_tensor(tokens)
        if tokens.ndim == 1:
            tokens = tokens.unsqueeze(0)
    tokens = tokens.detach().cpu()
    rows = []
    for call, spec in zip(calls, specs):
        pattern = _sites.value(trace, spec)
        if tuple(pattern.shape[:1]) + tuple(pattern.shape[2:]) != (tokens.shape[0], tokens.shape[1], tokens.shape[1]):
            raise MechInterpError("mi_tokens_mismatched", f"head_scores: tokens {tuple(tokens.shape)} do not match "
                                  f"the pattern {tuple(pattern.shape)} of {call.label!r}",
                                  remedy="pass the token ids the trace was captured on", tokens=tuple(tokens.shape),
                                  pattern=tuple(pattern.shape))
        rows.append(_score(pattern.detach().to("cpu", torch.float64), kind, tokens, exclude_bos,
                           exclude_current_token))
    n_heads = {r.shape[0] for r in rows}
    if len(n_heads) != 1:
        raise MechInterpError("mi_head_counts_differ", "head_scores: attention calls have different head counts "
                              f"({sorted(n_heads)}); a [layer, head] table needs one", remedy="score a model whose "
                              "layers have equal head counts", heads=sorted(n_heads))
    prov = {"kind": "induction" if isinstance(kind, FixedPeriodInduction) else kind,
            "period": kind.period if isinstance(kind, FixedPeriodInduction) else None,
            "convention": ("mean pattern[i, i - period + 1] over queries i with token[i] == token[i - period]"
                           if isinstance(kind, FixedPeriodInduction) else
                           "TransformerLens detect_head 'mul': sum(pattern * mask) / sum(pattern), mean over batch"),
            "exclude_bos": exclude_bos, "exclude_current_token": exclude_current_token, "tokens": source,
            "batch": int(tokens.shape[0]), "positions": int(tokens.shape[1]),
            "calls": tuple(c.label for c in calls)}
    return HeadScores(torch.stack(rows), prov["kind"], tuple(c.address for c in calls), prov)


def head_scores_sites(trace: Any) -> list[str]:
    """The op labels `head_scores(trace)` reads: every attention pattern's inputs and the token
    input (for `retention_plan`)."""
    labels = _sites.facet_sites(trace, _sites.attention_calls(trace), "pattern")
    token = _sites.token_input_label(trace)
    return labels + ([token] if token and token not in labels else [])


def _score(pattern: Any, kind: Any, tokens: Any, exclude_bos: bool, exclude_current_token: bool) -> Any:
    """Per-head scores [head] of one layer's pattern [batch, head, q, k] (float64)."""
    import torch

    mask, counted = _masks(kind, tokens)
    if counted is not None:
        if bool((counted == 0).any()):
            rows = [int(i) for i in torch.nonzero(counted == 0).flatten()]
            raise MechInterpError("mi_period_no_queries", f"head_scores: batch row(s) {rows} have no query i with "
                                  f"token[i] == token[i - {kind.period}]: nothing to score",
                                  remedy="score [bos] + R + R with len(R) == period", rows=rows, period=kind.period)
        per_row = (pattern * mask[:, None]).sum((-1, -2)) / counted[:, None]
        return per_row.mean(0)
    p = pattern.clone()
    if exclude_bos:
        p[..., 0] = 0
    if exclude_current_token:
        p = p * (1 - torch.eye(p.shape[-1], dtype=p.dtype))
    per_row = (p * mask[:, None]).sum((-1, -2)) / p.sum((-1, -2))
    return per_row.mean(0)


__all__ = ["head_scores", "head_scores_sites", "HeadScores", "FixedPeriodInduction", "KINDS"]
