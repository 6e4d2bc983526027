"""Prompt utilities: `inspect_prompt` (what the model predicted at every position of a
captured prompt) and `test_prompt` (teacher-forced scoring of a multi-token answer).

A tokenizer is any object with `encode(text) -> list of ids` and `decode(ids) -> text`
(`bos_token_id` optional). BOS is never silent: every record says whether a BOS token opens
the sequence, and whether the kit prepended it or the tokenizer's own `encode` did.
`test_prompt` follows TransformerLens's `utils.test_prompt` idea (credited): the answer is
appended to the prompt (with a leading space by default) and each answer token is scored at
the position before it in ONE forward pass; ranks here are one-based (1 = top).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError
from torchlens_mechinterp import _sites


@dataclass(frozen=True)
class TokenScore:
    """One scored position: the token that followed and how the model ranked it."""

    position: int
    token_id: int
    token: str | None
    logit: float
    logprob: float
    prob: float
    rank: int
    top: tuple[tuple[int, str | None, float], ...] = ()


@dataclass(frozen=True)
class PromptRecord:
    """`inspect_prompt`: per position, the next token's score and the model's top-k."""

    tokens: tuple[int, ...]
    texts: tuple[str | None, ...]
    bos: dict
    rows: tuple[TokenScore, ...]
    top_k: int

    def __str__(self) -> str:
        lines = [f"BOS: {self.bos['status']}"]
        for r in self.rows:
            tops = ", ".join(f"{t!r}:{p:.3f}" if t is not None else f"{i}:{p:.3f}" for i, t, p in r.top)
            lines.append(f"  pos {r.position:>3} next {r.token!r} rank {r.rank} p={r.prob:.3f} | top: {tops}")
        return "\n".join(lines)


@dataclass(frozen=True)
class AnswerScore:
    """`test_prompt`: the answer's tokens scored teacher-forced after the prompt."""

    prompt_tokens: tuple[int, ...]
    answer_tokens: tuple[int, ...]
    bos: dict
    rows: tuple[TokenScore, ...]
    trace: Any = field(repr=False, compare=False, default=None)

    @property
    def logprob(self) -> float:
        """Sum of the answer tokens' log-probabilities (the answer's teacher-forced log-likelihood)."""
        return float(sum(r.logprob for r in self.rows))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.rows)

    def __str__(self) -> str:
        lines = [f"BOS: {self.bos['status']}", f"prompt {list(self.prompt_tokens)} answer {list(self.answer_tokens)}"]
        for r in self.rows:
            lines.append(f"  answer token {r.token!r} (id {r.token_id}) at pos {r.position}: rank {r.rank}, "
                         f"logprob {r.logprob:.4f}, p={r.prob:.4f}")
        lines.append(f"  total logprob {self.logprob:.4f}")
        return "\n".join(lines)


def _check_tokenizer(tokenizer: Any, need: str = "encode") -> None:
    if tokenizer is None:
        return
    missing = [n for n in (need, "decode") if not callable(getattr(tokenizer, n, None))]
    if missing:
        raise MechInterpError("mi_tokenizer_invalid", f"the tokenizer has no callable {', '.join(missing)}",
                              remedy="pass an object with encode(text) -> ids and decode(ids) -> text",
                              missing=missing)


def _bos_id(tokenizer: Any) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return bos if isinstance(bos, int) and not isinstance(bos, bool) else None


def _text(tokenizer: Any, token: int) -> str | None:
    return None if tokenizer is None else str(tokenizer.decode([int(token)]))


def _logits(trace: Any, tokens_shape: tuple, function: str) -> Any:
    """The [batch, pos, vocab] logits among the trace's outputs (exactly one)."""
    found = []
    for op in trace.output_ops:
        v = op.out if op.saved else None
        if v is not None and getattr(v, "ndim", 0) == 3 and tuple(v.shape[:2]) == tuple(tokens_shape) and \
                "float" in str(v.dtype):
            found.append(v)
    if len(found) != 1:
        raise MechInterpError("mi_logits_unavailable", f"{function}: {len(found)} outputs hold [batch, pos, vocab] "
                              f"logits for tokens {tuple(tokens_shape)}", remedy="trace a causal language model whose "
                              "output is its logits (save the output)", function=function, found=len(found))
    return found[0]


def _score_rows(logits: Any, tokens: Any, positions: list[int], tokenizer: Any, top_k: int) -> list[TokenScore]:
    """Row b=0: the token at p + 1 scored from the logits at p, for every p in positions."""
    import torch

    logits = logits.detach().to(torch.float64)
    logprobs = torch.log_softmax(logits[0], dim=-1)
    rows = []
    for p in positions:
        nxt = int(tokens[0, p + 1])
        lp = logprobs[p]
        top = torch.topk(lp, min(top_k, lp.shape[-1])) if top_k else None
        rows.append(TokenScore(
            position=p, token_id=nxt, token=_text(tokenizer, nxt), logit=float(logits[0, p, nxt]),
            logprob=float(lp[nxt]), prob=float(lp[nxt].exp()), rank=int((logits[0, p] > logits[0, p, nxt]).sum()) + 1,
            top=tuple((int(i), _text(tokenizer, int(i)), float(v.exp())) for v, i in zip(top.values, top.indices))
            if top is not None else ()))
    return rows


def _check_top_k(top_k: Any) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise MechInterpError("mi_prompt_invalid", f"top_k={top_k!r} is not a non-negative int", remedy="top_k=5")


def inspect_prompt(trace: Any, tokenizer: Any = None, *, top_k: int = 5, tokens: Any = None) -> PromptRecord:
    """The captured prompt position by position: each next token's logit, log-probability,
    probability and one-based rank under the model's prediction, and the top-k (batch row 0)."""
    import torch

    _check_tokenizer(tokenizer, need="decode")
    _check_top_k(top_k)
    if tokens is None:
        tokens = _sites.input_tokens(trace)
        if tokens is None:
            raise MechInterpError("mi_tokens_unavailable", "inspect_prompt: the trace has no saved integer token input",
                                  remedy="pass tokens=<[batch, pos] token ids>", function="inspect_prompt")
    tokens = torch.as_tensor(tokens).reshape(-1, torch.as_tensor(tokens).shape[-1]).cpu()
    if tokens.shape[1] < 2:
        raise MechInterpError("mi_prompt_invalid", "inspect_prompt: a prompt of one token has no next token to score",
                              remedy="trace a prompt of two or more tokens")
    logits = _logits(trace, tuple(tokens.shape), "inspect_prompt")
    bos = _bos_id(tokenizer)
    first = int(tokens[0, 0])
    status = ("no tokenizer: BOS unknown" if tokenizer is None else "tokenizer has no bos_token_id: BOS unknown"
              if bos is None else f"present (position 0 is bos_token_id {bos})" if first == bos else
              f"absent (position 0 is {first}, bos_token_id is {bos})")
    rows = _score_rows(logits, tokens, list(range(tokens.shape[1] - 1)), tokenizer, top_k)
    texts = tuple(_text(tokenizer, int(t)) for t in tokens[0])
    return PromptRecord(tuple(int(t) for t in tokens[0]), texts,
                        {"status": status, "bos_token_id": bos, "first_token": first,
                         "present": (first == bos) if bos is not None else None}, tuple(rows), top_k)


def _encode(tokenizer: Any, value: Any, what: str) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise MechInterpError("mi_tokenizer_invalid", f"test_prompt: {what} is text and no tokenizer was given",
                                  remedy="pass tokenizer=, or token ids")
        ids = tokenizer.encode(value)
    else:
        ids = value
    try:
        import torch

        ids = [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]
    except (TypeError, ValueError):
        raise MechInterpError("mi_prompt_invalid", f"test_prompt: {what} is neither text nor token ids",
                              remedy="pass a string (with tokenizer=) or a list of ints") from None
    if not ids:
        raise MechInterpError("mi_prompt_invalid", f"test_prompt: {what} tokenizes to nothing",
                              remedy=f"pass a non-empty {what}", what=what)
    return ids


def test_prompt(model: Any, prompt: Any, answer: Any, tokenizer: Any = None, *, prepend_bos: bool | None = None,
                prepend_space_to_answer: bool = True, top_k: int = 10, trace_kwargs: dict | None = None) -> AnswerScore:
    """Score `answer` after `prompt` teacher-forced: one forward pass of prompt + answer, each
    answer token read at the position before it. `prepend_bos=None` prepends the tokenizer's
    BOS when it has one and the prompt does not already start with it (disclosed either way)."""
    import torch

    import torchlens as tl

    _check_tokenizer(tokenizer)
    _check_top_k(top_k)
    if prepend_bos not in (None, True, False):
        raise MechInterpError("mi_bos_policy_invalid", f"prepend_bos={prepend_bos!r}", remedy="True, False or None")
    bos = _bos_id(tokenizer)
    if prepend_bos is True and bos is None:
        raise MechInterpError("mi_bos_policy_invalid", "prepend_bos=True but the tokenizer has no bos_token_id",
                              remedy="pass prepend_bos=False, or a tokenizer with bos_token_id")
    if isinstance(answer, str) and prepend_space_to_answer and not answer.startswith(" "):
        answer = " " + answer
    p_ids = _encode(tokenizer, prompt, "prompt")
    a_ids = _encode(tokenizer, answer, "answer")
    answer_bos_stripped = False
    if bos is not None and isinstance(answer, str) and len(a_ids) > 1 and a_ids[0] == bos:
        a_ids, answer_bos_stripped = a_ids[1:], True  # a tokenizer whose encode adds BOS to every text
    if bos is None:
        status, prepended = ("no tokenizer bos_token_id: nothing prepended", False)
    elif p_ids[0] == bos:
        status, prepended = (f"present: the prompt already starts with bos_token_id {bos} (tokenizer or caller); "
                             "nothing prepended", False)
    elif prepend_bos is False:
        status, prepended = (f"absent: prepend_bos=False (bos_token_id {bos} not prepended)", False)
    else:
        status, prepended = (f"prepended: bos_token_id {bos} added at position 0", True)
    if prepended:
        p_ids = [bos] + p_ids
    ids = torch.tensor([p_ids + a_ids], dtype=torch.long)
    trace = tl.trace(model, ids, **dict(trace_kwargs or {}))
    logits = _logits(trace, tuple(ids.shape), "test_prompt")
    positions = [len(p_ids) - 1 + j for j in range(len(a_ids))]
    rows = _score_rows(logits, ids, positions, tokenizer, top_k)
    info = {"status": status, "bos_token_id": bos, "prepended": prepended,
            "answer_bos_stripped": answer_bos_stripped, "prepend_space_to_answer": prepend_space_to_answer}
    return AnswerScore(tuple(p_ids), tuple(a_ids), info, tuple(rows), trace)


test_prompt.__test__ = False  # not a pytest test, despite the name

__all__ = ["inspect_prompt", "test_prompt", "PromptRecord", "AnswerScore", "TokenScore"]
