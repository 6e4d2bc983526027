"""An independent evaluator for the oracle tests: JAX's own `make_jaxpr` of the model called
directly (parameters closed over, no TorchLens wrapper), walked with a plain eval_jaxpr loop
that steps into call primitives and returns every primitive's outputs in order. Shares no
code with torchlens_jax."""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Literal

_CALLS = {"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}


def _sub(eqn: Any):
    for k in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        j = eqn.params.get(k)
        if j is not None:
            return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, [])
    return None


def _run(jaxpr: Any, consts: list, args: list, trail: list) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub(eqn) if eqn.primitive.name in _CALLS else None
        if sub is not None:
            outs = _run(sub[0], list(sub[1]), ins, trail)
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
            trail.append((eqn.primitive.name, outs))
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def primitive_trail(model: Any, *args: Any) -> tuple[list[tuple[str, list]], Any]:
    """(primitive name, outputs) for every primitive the model executes, and its output."""
    closed = jax.make_jaxpr(lambda *a: model(*a))(*args)
    trail: list = []
    out = _run(closed.jaxpr, list(closed.consts), list(jax.tree_util.tree_leaves(args)), trail)
    return trail, out
