"""TransformerLens hook-name aliases (off by default): `hook_q` -> `q`, `hook_pattern` ->
`pattern`, ... resolve to native facets when those exist. Process-wide switch."""

from __future__ import annotations

from typing import Any

#: TransformerLens hook name -> native facet name
TRANSFORMER_LENS_ALIASES: dict[str, str] = {
    "hook_q": "q", "hook_k": "k", "hook_v": "v", "hook_pattern": "pattern", "hook_attn_scores": "scores",
    "hook_z": "z", "hook_result": "result", "hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post", "hook_pre": "pre", "hook_post": "post", "hook_mlp_out": "out",
}
_ENABLED = [False]


def enable_transformer_lens_aliases(enabled: bool = True) -> None:
    """Turn the TransformerLens aliases on (or off) for this process; traces' facet views
    built afterwards include them."""
    _ENABLED[0] = bool(enabled)


def transformer_lens_aliases_enabled() -> bool:
    return _ENABLED[0]


def alias_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """Alias entries for the native facets present in `entries` (none when disabled)."""
    if not _ENABLED[0]:
        return {}
    from dataclasses import replace

    out = {}
    for alias, native in TRANSFORMER_LENS_ALIASES.items():
        e = entries.get(native)
        if e is not None and e.kind not in ("structural", "position") and alias not in entries:
            out[alias] = replace(e, name=alias, kind="alias")
    return out


__all__ = ["TRANSFORMER_LENS_ALIASES", "enable_transformer_lens_aliases", "transformer_lens_aliases_enabled",
           "alias_entries"]
