"""`tl.lens`: the logit lens (experimental; `torchlens._semantic` is an alias).

Projects each block's residual-stream facet (default `resid_post`) through the model's own
final norm and unembedding, as the `language_model_head` facet recipe anchors them. The
lens is validated before use: applied to the LAST block's facet it must reproduce the
captured logits, otherwise it refuses (`logit_lens_verification_failed`) instead of
mislabelling layers; `verify=False` trusts it, `lens=` supplies your own callable (or a
per-address mapping), `modules=` / `facet=` choose what is projected.

The arithmetic runs on the trace's own values through the backend's edit ops (`mean`) and
operators every array type has (`-`, `*`, `**`, `@`), so this module imports no framework.
Top-k tables work on host (NumPy) copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from torchlens.errors import LogitLensError


def _np(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach()
    if hasattr(v, "cpu"):
        v = v.cpu()
    if hasattr(v, "float") and str(getattr(v, "dtype", "")).endswith(("bfloat16", "float16")):
        v = v.float()
    return np.asarray(v)


@dataclass(frozen=True)
class LensEntry:
    """One projected layer: the module address, its logits and where they came from."""

    address: str
    logits: Any
    provenance: str = "projected through final norm/head"


@dataclass
class LensResult:
    """The per-layer projections (`entries`, in depth order) and the lens used."""

    entries: list[LensEntry]
    lens_source: str
    validated: bool
    facet: str
    max_abs_error: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def stacked(self) -> np.ndarray:
        """(n_layers, *logits_shape) as a NumPy array."""
        return np.stack([_np(e.logits) for e in self.entries])

    def top_tokens(self, k: int = 5, tokenizer: Any = None, position: int = -1, batch: int = 0) -> list[list[tuple]]:
        """Per layer, the top-`k` (token, probability) at `position` of batch row `batch`
        (full-vocabulary softmax). Tokens are ids, or strings via `tokenizer`."""
        out = []
        for e in self.entries:
            row = _np(e.logits)[batch]
            row = row[position] if row.ndim > 1 else row
            row = row.astype(np.float64)
            p = np.exp(row - row.max())
            p /= p.sum()
            ids = np.argsort(-row, kind="stable")[:k]
            out.append([(_token(tokenizer, int(i)), float(p[i])) for i in ids])
        return out

    def summary(self, tokenizer: Any = None, position: int = -1) -> str:
        """A per-layer top-1 table at `position`."""
        lines = [f"logit lens ({self.facet}, {self.lens_source}{', validated' if self.validated else ''})"]
        for e, top in zip(self.entries, self.top_tokens(1, tokenizer, position)):
            tok, p = top[0]
            lines.append(f"  {e.address:32s} {tok!s:>16s}  p={p:.3f}")
        return "\n".join(lines)


def _token(tokenizer: Any, i: int) -> Any:
    if tokenizer is None:
        return i
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return tokenizer.convert_ids_to_tokens(i)
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode([i])
    return i


def _head(trace: Any) -> Any:
    """The one head module: a language-model head, else (vision) a classification head."""
    from torchlens.facets.view import modules_with_facet

    heads = (modules_with_facet(trace, "unembed_weight") or modules_with_facet(trace, "classifier_weight")
             or modules_with_facet(trace, "image_projection_weight"))
    if len(heads) != 1:
        raise LogitLensError("logit_lens_head_unavailable", f"{len(heads)} modules carry a language-model or "
                             "classification head in this trace; the lens needs exactly one",
                             remedy="pass lens= with your own projection", heads=[m.address for m in heads])
    return heads[0]


#: the head facet that names each lens source, and the facet holding the head's captured output
_SOURCES = (("classifier_weight", "classifier_head", "logits"),
            ("image_projection_weight", "contrastive_head", "logits_per_image"))


def lens_source(trace: Any) -> str:
    f = _head(trace).facets
    return next((src for name, src, _ in _SOURCES if name in f), "language_model_head")


def _head_output(trace: Any) -> Any:
    f = _head(trace).facets
    return f[next((out for name, _, out in _SOURCES if name in f), "logits")].value


def head_projection(trace: Any) -> Callable[[Any], Any]:
    """The model's final norm + unembedding as a function of a residual-stream value,
    rebuilt from the head module's facets."""
    from torchlens.backends.protocol import edit_ops_of

    f = _head(trace).facets
    if "final_norm_kind" not in f or "final_norm_gamma" not in f:
        raise LogitLensError("logit_lens_head_unavailable", "the head's final norm was not found structurally",
                             remedy="pass lens= with your own projection")
    kind = f["final_norm_kind"].value
    eps = f["final_norm_eps"].value if "final_norm_eps" in f else 1e-5
    gamma = f["final_norm_gamma"].value
    beta = f["final_norm_beta"].value if "final_norm_beta" in f else None
    classifier = "classifier_weight" in f
    contrastive = not classifier and "image_projection_weight" in f
    w = f["classifier_weight" if classifier else "image_projection_weight" if contrastive else "unembed_weight"].value
    bias_name = "classifier_bias" if classifier else "unembed_bias"
    b = f[bias_name].value if bias_name in f and not contrastive else None
    pos = f["pooled_position"].value if classifier or contrastive else None
    ops = edit_ops_of(trace._backend, "the logit lens")
    if contrastive:  # CLIP: scored against the captured text features with the model's own logit_scale
        if "text_features" not in f or "logit_scale" not in f:
            raise LogitLensError("logit_lens_head_unavailable", "the contrastive head has no captured text features "
                                 "or logit_scale", remedy="capture the model on images AND the label prompts "
                                 "(input_ids=...)")
        text = f["text_features"].value
        text = text * (ops.mean(text * text, -1, True) * text.shape[-1]) ** -0.5
        scale = float(np.exp(_np(f["logit_scale"].value).astype(np.float64)).reshape(-1)[0])

    def project(x: Any) -> Any:
        if pos is not None:  # the one token a classification head reads ([CLS])
            x = x[(slice(None), pos)]
        if kind == "layer_norm":
            mu = ops.mean(x, -1, True)
            c = x - mu
            y = c * (ops.mean(c * c, -1, True) + eps) ** -0.5
        else:
            y = x * (ops.mean(x * x, -1, True) + eps) ** -0.5
        y = y * gamma
        if beta is not None:
            y = y + beta
        logits = y @ w.swapaxes(0, 1)
        if contrastive:
            logits = logits * (ops.mean(logits * logits, -1, True) * logits.shape[-1]) ** -0.5
            return (logits @ text.swapaxes(0, 1)) * scale
        return logits if b is None else logits + b

    return project


def _scope(trace: Any) -> str | None:
    try:
        f = _head(trace).facets
    except LogitLensError:
        return None
    scope = f["tower_address"].value if "tower_address" in f else None
    return None if scope in (None, "", "self") else scope  # the root: every block feeds the head


def _blocks(trace: Any, facet: str, modules: Any) -> list[Any]:
    from torchlens.facets.view import modules_with_facet

    if modules is None:
        found = modules_with_facet(trace, facet)
        scope = _scope(trace)
        if scope is not None:  # a two-tower model (CLIP): only the tower the head reads
            found = [m for m in found if m.address.startswith(scope + ".")]
    else:
        found = []
        for a in modules:
            m = trace._modules.get(a)
            scope = _scope(trace)
            if scope is not None and m is not None and not a.startswith(scope + "."):
                raise LogitLensError("logit_lens_layer_outside_head", f"module {a!r} is outside the tower the head "
                                     f"reads ({scope!r})", remedy=f"pass blocks under {scope!r}", module=a,
                                     tower=scope)
            if m is None or facet not in m.facets:
                raise LogitLensError("logit_lens_facet_unavailable", f"module {a!r} has no facet {facet!r} now",
                                     remedy="pass modules with that facet (trace.modules_with_facet(facet))",
                                     module=a, facet=facet)
            found.append(m)
    if not found:
        raise LogitLensError("logit_lens_facet_unavailable", f"no module provides {facet!r} in this trace",
                             remedy="capture with save='all', or pass facet= / modules=", facet=facet)
    return found


def _kept(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`x` cut to the positions a `logits_to_keep`-sliced capture `y` kept (HF keeps the last
    n positions: `[batch, n, vocab]` out of `[batch, pos, vocab]`); `x` unchanged otherwise."""
    if x.ndim == y.ndim >= 3 and x.shape[0] == y.shape[0] and x.shape[2:] == y.shape[2:] \
            and 0 < y.shape[1] < x.shape[1]:
        return x[:, x.shape[1] - y.shape[1]:]
    return x


def _kept_note(projected: Any, captured: Any) -> str:
    """The remedy's first words when the capture kept fewer positions than it projected."""
    a, b = tuple(getattr(projected, "shape", ())), tuple(getattr(captured, "shape", ()))
    if len(a) == len(b) >= 3 and b[1] < a[1]:
        return (f"the capture kept {b[1]} of {a[1]} positions (logits_to_keep); the lens checks the last {b[1]}, so a "
                "logits_to_keep of other positions cannot be validated; otherwise ")
    return ""


def _close(a: Any, b: Any) -> tuple[bool, float]:
    x, y = _np(a).astype(np.float64), _np(b).astype(np.float64)
    x = _kept(x, y)
    if x.shape != y.shape:
        return False, float("inf")
    err = float(np.max(np.abs(x - y))) if x.size else 0.0
    return bool(np.allclose(x, y, rtol=1e-4, atol=1e-4)), err


def model_identity(trace: Any) -> dict[str, Any]:
    """The measured model-identity record of a trace's source model (experimental): its
    class, backend and the full parameter hash taken from the values the trace holds. This
    is the record an extraction artifact stores as `manifest["signature"]["model_identity"]`
    and a user lens carries as `lens.model_identity`. `param_hash_full` is None when the
    trace cannot vouch for its capture-time bytes (`trace.provenance.unavailable` says why);
    such a record cannot be compared."""
    p = trace.provenance
    return {"kind": "measured", "model_class": p.model_class, "backend": p.backend,
            "param_hash_full": p.param_hash_full}


def _identities(lens: Any, addresses: list[str]) -> list[Any]:
    """Every model_identity a lens records: on the callable or mapping, and on each per-layer
    callable the projection uses."""
    found = [getattr(lens, "model_identity", None)]
    if isinstance(lens, dict):
        found += [getattr(lens.get(a), "model_identity", None) for a in addresses]
    return [r for r in found if r is not None]


def _comparable(record: Any) -> bool:
    return isinstance(record, dict) and record.get("kind", "measured") == "measured" \
        and record.get("param_hash_full") is not None


def _check_identity(trace: Any, lens: Any, addresses: list[str], verify: bool,
                    last: Callable[[], Any] | None) -> str:
    """The spec's user-lens identity check: 'match', 'mismatch' (raised unless verify=False),
    or 'unrecorded' (no comparable record: a last-layer agreement check, warning
    `logit_lens_identity_unrecorded` when the lens does not reproduce the captured logits)."""
    import warnings

    from torchlens.errors import LogitLensWarning

    mine = model_identity(trace)
    records = _identities(lens, addresses)
    measured = [r for r in records if _comparable(r)] if mine["param_hash_full"] is not None else []
    for r in measured:
        diff = sorted(k for k in ("model_class", "param_hash_full") if k in r and r[k] != mine[k])
        if diff:
            if verify:
                raise LogitLensError("logit_lens_identity_mismatch", f"the lens was built for another model: its "
                                     f"model_identity differs from the traced model's in {diff}",
                                     remedy="use the lens fitted for this model, or pass verify=False to run it "
                                     "anyway", differing=diff)
            return "mismatch"
    if measured and len(measured) == len(records):
        return "match"
    if last is None:
        return "unrecorded"  # the lens has no projection for the last block
    try:
        captured = _head_output(trace)
    except LogitLensError:
        return "unrecorded"  # no captured logits to agree with
    x, y = _np(last()).astype(np.float64), _np(captured).astype(np.float64)
    x = _kept(x, y)
    if x.shape != y.shape:
        err, agree = float("inf"), 0.0
    else:
        err = float(np.max(np.abs(x - y))) if x.size else 0.0
        agree = float(np.mean(x.argmax(-1) == y.argmax(-1))) if x.size else 1.0
    if x.shape != y.shape or not np.allclose(x, y, rtol=1e-4, atol=1e-4):
        warnings.warn(LogitLensWarning("logit_lens_identity_unrecorded", f"the lens records no comparable "
                                       f"model_identity and, applied to the last block, differs from the captured "
                                       f"logits by {err:.3g} (top-1 agreement {agree:.1%})",
                                       remedy="set lens.model_identity = tl.lens.model_identity(trace) when you "
                                       "build it for this model", max_abs_error=err, top1_agreement=agree),
                      stacklevel=3)
    return "unrecorded"


def logit_lens(trace: Any, *, facet: str = "resid_post", modules: Any = None, lens: Any = None,
               verify: bool = True, validate: bool = True) -> LensResult:
    """Project each block's `facet` through the model's final norm and unembedding. A user
    `lens=` is checked against its `model_identity` when `validate` (see `model_identity`)."""
    blocks = _blocks(trace, facet, modules)
    source = "user_lens" if lens is not None else lens_source(trace)
    if lens is None:
        project = head_projection(trace)
    elif callable(lens):
        project = lens
    elif isinstance(lens, dict):
        project = None
    else:
        raise LogitLensError("logit_lens_head_unavailable", f"lens= takes a callable or a mapping, not "
                             f"{type(lens).__name__}", remedy="lens=lambda x: ...")

    def apply(address: str, x: Any) -> Any:
        fn = project if project is not None else lens.get(address)
        if fn is None:
            raise LogitLensError("logit_lens_facet_unavailable", f"lens mapping has no entry for {address!r}",
                                 remedy="give the mapping one callable per projected module", module=address)
        return fn(x)

    identity = None
    if lens is not None and validate:
        tail = _blocks(trace, facet, None)[-1]
        tail_fn = lens if callable(lens) else lens.get(tail.address)
        identity = _check_identity(trace, lens, [m.address for m in blocks] + [tail.address], verify,
                                   None if tail_fn is None else lambda: tail_fn(tail.facets[facet].value))
    entries = [LensEntry(m.address, apply(m.address, m.facets[facet].value)) for m in blocks]
    validated, err = False, None
    if verify and lens is None:
        last = entries[-1].logits if modules is None else apply(
            _blocks(trace, facet, None)[-1].address, _blocks(trace, facet, None)[-1].facets[facet].value)
        captured = _head_output(trace)
        validated, err = _close(last, captured)
        if not validated:
            raise LogitLensError("logit_lens_verification_failed", f"the reconstructed head applied to the last "
                                 f"block's {facet} differs from the captured logits by {err:.3g}",
                                 remedy=_kept_note(last, captured) + "the head is not a plain final norm + "
                                 "unembedding (e.g. a (1 + weight) RMSNorm): pass lens= or verify=False to trust it",
                                 max_abs_error=err)
    return LensResult(entries, source, validated, facet, err, extra={} if identity is None else {"identity": identity})


@dataclass(frozen=True)
class PredictionRow:
    """One layer's streamed reduction at the requested positions (arrays are
    `[batch, n_positions, ...]`): top-k ids and logits, the full-vocabulary logsumexp, and
    the requested tokens' logits, probabilities and one-based ranks."""

    address: str
    positions: tuple[int, ...]
    top_ids: np.ndarray
    top_logits: np.ndarray
    logsumexp: np.ndarray
    token_logits: np.ndarray
    token_probs: np.ndarray
    token_ranks: np.ndarray
    provenance: str


@dataclass
class Predictions:
    rows: list[PredictionRow]
    validated: bool
    facet: str
    tokens: tuple[int, ...]


def _reduce(address: str, logits: Any, k: int, positions: Any, tokens: tuple[int, ...], banned: Any,
            provenance: str, offset: int = 0, total: int | None = None) -> PredictionRow:
    """One row's reduction. `offset`/`total`: the row holds positions offset .. offset + n - 1
    of a `total`-long sequence (a logits_to_keep capture); requested positions count in the
    whole sequence, and those the row does not cover are dropped, not invented."""
    x = _np(logits).astype(np.float64)
    if x.ndim == 2:  # [batch, vocab]: one position
        x = x[:, None, :]
    n = x.shape[1]
    total = n if total is None else total
    wanted = range(offset, offset + n) if positions is None else positions
    pos = tuple(p for p in wanted if -total <= p < total and offset <= p % total < offset + n)
    x = x[:, [p % total - offset for p in pos], :]
    if banned is not None:
        for b, ids in enumerate(banned):
            x[b, :, ids] = -np.inf
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    order = np.argsort(-x, axis=-1, kind="stable")
    top = order[..., :k]
    tok = np.asarray(tokens, dtype=np.int64)
    tok_logits = x[..., tok] if tok.size else np.zeros(x.shape[:2] + (0,))
    ranks = (x[..., None, :] > tok_logits[..., :, None]).sum(-1) + 1 if tok.size else np.zeros(x.shape[:2] + (0,), int)
    return PredictionRow(address, pos, top, np.take_along_axis(x, top, -1), lse, tok_logits,
                         np.exp(tok_logits - lse[..., None]), ranks, provenance)


def logit_lens_predictions(trace: Any, *, k: int = 5, positions: Any = None, tokens: Any = (),
                           facet: str = "resid_post", modules: Any = None, lens: Any = None, verify: bool = True,
                           mask_input: bool = False, include_native: bool = True,
                           validate: bool = True) -> Predictions:
    """The streaming reduction of `logit_lens`: one layer projected at a time, keeping only
    per-position top-k, the full-vocabulary logsumexp and the requested tokens' logits,
    probabilities and one-based ranks. `include_native` appends the captured logits' row."""
    tokens = tuple(int(t) for t in tokens)
    banned = None
    if mask_input:
        ins = trace.input_ops
        first = ins[0] if ins else None
        if first is None or not first.saved or "int" not in str(first.dtype):
            raise LogitLensError("logit_lens_mask_input_unavailable", "mask_input=True needs the trace's first input "
                                 "to be a saved integer token-id tensor", remedy="trace the token ids (save='all')")
        ids = _np(first.out)
        banned = [np.unique(r) for r in ids.reshape(ids.shape[0], -1)]
    blocks = _blocks(trace, facet, modules)
    project = head_projection(trace) if lens is None else None
    if lens is not None and validate:
        if not callable(lens) and not isinstance(lens, dict):
            raise LogitLensError("logit_lens_head_unavailable", f"lens= takes a callable or a mapping, not "
                                 f"{type(lens).__name__}", remedy="lens=lambda x: ...")
        tail = _blocks(trace, facet, None)[-1]
        tail_fn = lens if callable(lens) else lens.get(tail.address)
        _check_identity(trace, lens, [m.address for m in blocks] + [tail.address], verify,
                        None if tail_fn is None else lambda: tail_fn(tail.facets[facet].value))
    rows = []
    n_pos = None
    validated = False
    for i, m in enumerate(blocks):
        x = m.facets[facet].value
        fn = project if project is not None else (lens if callable(lens) else lens[m.address])
        logits = fn(x)
        if verify and lens is None and i == len(blocks) - 1 and modules is None:
            captured = _head_output(trace)
            validated, err = _close(logits, captured)
            if not validated:
                raise LogitLensError("logit_lens_verification_failed", f"the reconstructed head applied to the last "
                                     f"block's {facet} differs from the captured logits by {err:.3g}",
                                     remedy=_kept_note(logits, captured) + "pass lens= or verify=False",
                                     max_abs_error=err)
        rows.append(_reduce(m.address, logits, k, positions, tokens, banned, "projected through final norm/head"))
        shape = getattr(logits, "shape", ())
        n_pos = int(shape[1]) if len(shape) >= 3 else n_pos
        del logits  # one layer's full projection at a time
    if include_native:
        native = _head_output(trace)
        shape = getattr(native, "shape", ())
        # a logits_to_keep capture kept only the last positions: the native row covers those alone
        offset = n_pos - int(shape[1]) if n_pos is not None and len(shape) >= 3 and int(shape[1]) < n_pos else 0
        rows.append(_reduce("native", native, k, positions, tokens, banned, "native output", offset=offset,
                            total=n_pos if offset else None))
    return Predictions(rows, validated, facet, tokens)


__all__ = ["logit_lens", "logit_lens_predictions", "head_projection", "model_identity", "LensResult", "LensEntry", "Predictions",
           "PredictionRow"]
