"""`tl.pluck` and `tl.extract`: the saved outs of chosen layers for one input.

They are `tl.trace(model, *inputs, save=layers)` with only the named outs handed back;
layer names are whatever `trace.ops[name]` resolves (labels and module names). Outs are
detached by default; `detach_saved_activations=False` returns graph-connected outs.
"""

from __future__ import annotations

from typing import Any

from torchlens.errors import InvalidArgumentError


def layer_names(layers: Any) -> list[str]:
    names = [layers] if isinstance(layers, str) else list(layers) if isinstance(layers, (list, tuple)) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError("extraction_layers_invalid", f"layers={layers!r} is not a name or a list of names",
                                   remedy="layers=['fc1', 'relu_2'] (op labels or module addresses)")
    if len(set(names)) != len(names):
        raise InvalidArgumentError("extraction_layers_invalid", f"layers={names!r} names a layer twice",
                                   remedy="list each layer once")
    return names


def input_args(inputs: Any) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def extract(model: Any, inputs: Any, layers: Any, detach_saved_activations: bool = True) -> dict[str, Any]:
    """{layer: saved out} for each of `layers` on `model(*inputs)` (a tuple is several
    positional inputs)."""
    from torchlens.capture import trace
    from torchlens.options import CaptureOptions

    names = layer_names(layers)
    if not isinstance(detach_saved_activations, bool):
        raise InvalidArgumentError("invalid_argument", "detach_saved_activations takes a bool", remedy="True or False")
    t = trace(model, *input_args(inputs), save=names, capture=CaptureOptions(detach_saved_activations=detach_saved_activations))
    return {name: t.ops[name].out for name in names}


def pluck(model: Any, inputs: Any, layer: str, detach_saved_activations: bool = True) -> Any:
    """The saved out of one layer on `model(*inputs)`."""
    if not isinstance(layer, str):
        raise InvalidArgumentError("extraction_layers_invalid", f"pluck takes one layer name, not {layer!r}",
                                   remedy="tl.pluck(model, x, 'fc1'); tl.extract for several")
    return extract(model, inputs, [layer], detach_saved_activations)[layer]
