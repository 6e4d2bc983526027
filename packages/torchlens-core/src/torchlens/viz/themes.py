"""Drawing themes: colours, fonts and per-kind node styles.

A theme is data; `draw(theme=...)` picks one by name. The node kinds are the marks a
drawing can contain: input, output, buffer, constant, param (an op that reads parameters),
compute (any other op), module (a folded module call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlens.errors import InvalidArgumentError

NODE_KINDS = ("input", "output", "buffer", "constant", "param", "compute", "module", "repeat", "container")

#: What each kind is called in the legend.
KIND_LEGEND = {
    "input": "model input",
    "output": "model output",
    "buffer": "buffer",
    "constant": "constant",
    "param": "op reading parameters",
    "compute": "op",
    "module": "module call (folded)",
    "repeat": "repeated blocks (folded, +N more)",
    "container": "container (folded leaves or record)",
}


@dataclass(frozen=True)
class NodeStyle:
    fill: str
    border: str
    style: str = "filled,rounded"  # graphviz node style
    font: str = ""  # font colour; "" means the theme's
    peripheries: int = 1


@dataclass(frozen=True)
class Theme:
    name: str
    background: str
    font: str
    fontname: str
    edge: str
    cluster_border: str
    cluster_fills: tuple[str, ...]  # by nesting level, cycled
    cluster_font: str
    nodes: dict[str, NodeStyle] = field(default_factory=dict)
    ramp_high_dark: bool = True  # sequential ramp: dark = high on a light page

    def node(self, kind: str) -> NodeStyle:
        return self.nodes.get(kind, self.nodes["compute"])


_LIGHT = Theme(
    name="light", background="white", font="#1f2328", fontname="Helvetica", edge="#57606a",
    cluster_border="#8c959f", cluster_fills=("#f6f8fa", "#eaeef2"), cluster_font="#424a53",
    nodes={
        "input": NodeStyle("#d3f5dc", "#1a7f37"),
        "output": NodeStyle("#ffdcd7", "#cf222e"),
        "buffer": NodeStyle("#fff1c2", "#9a6700", "filled,dashed"),
        "constant": NodeStyle("#f6f8fa", "#6e7781", "filled,dotted"),
        "param": NodeStyle("#dde3ea", "#424a53", "filled"),
        "compute": NodeStyle("#ffffff", "#57606a", "filled"),
        "module": NodeStyle("#ddf4ff", "#0969da", "filled", peripheries=2),
        "repeat": NodeStyle("#ddf4ff", "#0969da", "filled,dashed", peripheries=2),
        "container": NodeStyle("#ffffff", "#6e7781", "filled,dashed"),
    },
)

_DARK = Theme(
    name="dark", background="#0d1117", font="#e6edf3", fontname="Helvetica", edge="#8b949e",
    cluster_border="#6e7681", cluster_fills=("#161b22", "#21262d"), cluster_font="#c9d1d9",
    nodes={
        "input": NodeStyle("#0f3d21", "#3fb950"),
        "output": NodeStyle("#4c1a1d", "#f85149"),
        "buffer": NodeStyle("#3b2e0a", "#d29922", "filled,dashed"),
        "constant": NodeStyle("#21262d", "#8b949e", "filled,dotted"),
        "param": NodeStyle("#30363d", "#b1bac4", "filled"),
        "compute": NodeStyle("#0d1117", "#8b949e", "filled"),
        "module": NodeStyle("#0c2d6b", "#58a6ff", "filled", peripheries=2),
        "repeat": NodeStyle("#0c2d6b", "#58a6ff", "filled,dashed", peripheries=2),
        "container": NodeStyle("#0d1117", "#8b949e", "filled,dashed"),
    },
    ramp_high_dark=False,
)

_PAPER = Theme(
    name="paper", background="white", font="black", fontname="Times-Roman", edge="#333333",
    cluster_border="#777777", cluster_fills=("#fafafa", "#f0f0f0"), cluster_font="#333333",
    nodes={
        "input": NodeStyle("#eeeeee", "black"),
        "output": NodeStyle("#eeeeee", "black", "filled,rounded,bold"),
        "buffer": NodeStyle("white", "#555555", "filled,dashed"),
        "constant": NodeStyle("white", "#555555", "filled,dotted"),
        "param": NodeStyle("#d9d9d9", "black", "filled"),
        "compute": NodeStyle("white", "black", "filled"),
        "module": NodeStyle("#f0f0f0", "black", "filled", peripheries=2),
        "repeat": NodeStyle("#f0f0f0", "black", "filled,dashed", peripheries=2),
        "container": NodeStyle("white", "#555555", "filled,dashed"),
    },
)

#: Theme names `draw(theme=...)` accepts; "torchlens" is the house style (the light skin).
THEMES: dict[str, Theme] = {"light": _LIGHT, "torchlens": _LIGHT, "dark": _DARK, "paper": _PAPER}


def get_theme(name: str) -> Theme:
    if isinstance(name, Theme):
        return name
    theme = THEMES.get(name) if isinstance(name, str) else None
    if theme is None:
        raise InvalidArgumentError("visualization_theme_invalid", f"unknown theme {name!r}",
                                   remedy=f"use one of {', '.join(sorted(THEMES))}", theme=repr(name))
    return theme
