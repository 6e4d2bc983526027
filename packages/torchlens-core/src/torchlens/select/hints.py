"""Why a selector matched nothing: a hint a user can act on.

An empty match is a valid answer for `trace[selector]`, but an edit staged on it silently does
nothing, so the zero-fire warning (or error) of `do`/`intervene=`/`bind` says why: the
nearest function names for a misspelt `tl.func`, "exists but was never called" for a module
that ran zero times, the calls a module did make for a call number past them, or that each
part of a composition matches but the combination does not. Reads records only; never raises.
"""

from __future__ import annotations

import difflib
from typing import Any

from torchlens.records.collections import split_pass_token
from torchlens.select.selectors import (
    FuncSelector,
    InModuleSelector,
    ModuleSelector,
    Selector,
    WhereSelector,
    _And,
    _Not,
    _Or,
    _Sub,
)

__all__ = ["no_match_hint", "nearest_func_names"]

_MAX_LISTED = 8


def nearest_func_names(trace: Any, name: str, n: int = 3) -> list[str]:
    """The recorded callable names closest to `name` (difflib ratio), best first."""
    names = sorted({o.func_name for o in trace._ops.values() if o.kind in ("op", "constant") and o.func_name})
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    if not close:  # a substring (`"attention"` for `scaled_dot_product_attention`) is a near miss too
        close = [x for x in names if name.lower() in x.lower() or x.lower() in name.lower()][:n]
    return close


def _func_hint(trace: Any, sel: FuncSelector) -> str:
    close = nearest_func_names(trace, sel.name)
    if close:
        return f"no op calls {sel.name!r}; nearest function names: {', '.join(close)}"
    names = sorted({o.func_name for o in trace._ops.values() if o.kind == "op" and o.func_name})
    listed = ", ".join(names[:_MAX_LISTED]) + (", ..." if len(names) > _MAX_LISTED else "")
    return f"no op calls {sel.name!r}; function names in this trace: {listed or 'none'}"


def _module_hint(trace: Any, address: str) -> str | None:
    modules = trace._modules
    base, token = split_pass_token(address)
    if address in modules:
        base, token = address, None
    if base in trace.uncalled_modules:  # an uncalled module has no record (spec glossary)
        return f"module {base!r} exists but was never called during the forward, so it has no ops"
    mod = modules.get(base)
    if mod is None:
        return None  # an unknown address raises label_unknown (with suggestions) before this point
    calls = list(getattr(mod, "calls", ()) or ())
    if not calls:
        return f"module {base!r} exists but was never called during the forward, so it has no ops"
    if token is not None and token.isdigit():
        return f"module {base!r} ran {len(calls)} time(s); there is no call {base}:{token} (calls are 1-based)"
    return None


def _leaf_hints(trace: Any, sel: Any) -> list[str]:
    if isinstance(sel, FuncSelector):
        return [_func_hint(trace, sel)]
    if isinstance(sel, (ModuleSelector, InModuleSelector)):
        hint = _module_hint(trace, sel.address)
        return [hint] if hint else []
    if isinstance(sel, WhereSelector):
        return [f"{sel!r} is false for every op"]
    return []


def _hints(trace: Any, sel: Any) -> list[str]:
    """Hints for the parts of `sel` that match nothing (the first reason each)."""
    if isinstance(sel, (_And, _Sub)):
        parts = [p for p in (sel.a, sel.b) if _matches(trace, p) == set()]
        if isinstance(sel, _Sub):
            parts = parts[:1] if sel.a in parts else []
        found = [h for p in parts for h in _hints(trace, p)]
        if found:
            return found
        word = "both" if isinstance(sel, _And) else "the first but not the second"
        return [f"each part of {sel!r} matches sites, but no site matches {word}"]
    if isinstance(sel, _Or):
        return [h for p in (sel.a, sel.b) for h in _hints(trace, p)]
    if isinstance(sel, _Not):
        return [f"{sel.a!r} matches every op, so {sel!r} matches none"]
    return _leaf_hints(trace, sel)


def _matches(trace: Any, sel: Any) -> set | None:
    try:
        return sel.match_set(trace)
    except Exception:  # noqa: BLE001 - a hint must never replace the caller's own error
        return None


def no_match_hint(trace: Any, target: Any) -> str:
    """One sentence (possibly several joined by "; ") saying why `target` matches no site on
    `trace`; "" when there is nothing more useful to say. `target` is a selector, or a
    `tl.units`/`tl.subspace` site wrapping one."""
    seen = 0
    while not isinstance(target, Selector) and hasattr(target, "site") and seen < 8:
        target, seen = target.site, seen + 1
    if not isinstance(target, Selector) or trace is None:
        return ""
    try:
        return "; ".join(dict.fromkeys(_hints(trace, target)))
    except Exception:  # noqa: BLE001 - a hint must never replace the caller's own error
        return ""
