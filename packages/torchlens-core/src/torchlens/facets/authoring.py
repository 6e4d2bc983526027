"""Recipe-authoring helpers, public under `tl.facets`: read a module's config, turn a child
module's output or a parameter into a FacetSpec, and find the module call a recipe runs for.

A recipe receives the Module record, not the live module. While the facet view runs a
recipe for one call, `current_call(module)` is that call, and the child helpers resolve a
child module to its call inside it (an attention layer shared across depth gets pass n's
projections for call n).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from torchlens.errors import FacetError
from torchlens.facets.spec import FacetSpec

_CALL: contextvars.ContextVar[Any] = contextvars.ContextVar("torchlens_facet_call", default=None)
_MISSING = object()


@contextlib.contextmanager
def running_for(call: Any) -> Iterator[None]:
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def current_call(module: Any) -> Any:
    """The ModuleCall of `module` the running recipe is for (its only call outside a view)."""
    call = _CALL.get()
    if call is not None and call.address == module.address:
        return call
    calls = list(module.calls)
    if len(calls) != 1:
        raise FacetError("facet_module_multi_call", f"module {module.address!r} ran {len(calls)} calls; a recipe "
                         "helper needs the call it runs for", remedy="read facets through module.calls[n].facets",
                         module=module.address, calls=len(calls))
    return calls[0]


def config_value(module: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of `names` the module record holds as an attribute or in its
    `custom_attributes` snapshot (head counts, dims, epsilons)."""
    custom = getattr(module, "custom_attributes", None) or {}
    for name in names:
        value = getattr(module, name, _MISSING) if not name.startswith("_") else _MISSING
        if value is not _MISSING and not callable(value):
            return value
        if name in custom:
            return custom[name]
    if default is not _MISSING:
        return default
    raise FacetError("facet_config_missing", f"module {module.address!r} records none of {', '.join(names)}",
                     remedy="pass the value explicitly in the recipe (head counts cannot be recovered from shapes)",
                     module=module.address, names=list(names))


def child_call(module: Any, child_name: str) -> Any:
    """The call of child `child_name` that ran inside the current call of `module`."""
    trace = module._trace
    address = child_name if module.address == "self" else f"{module.address}.{child_name}"
    child = trace._modules.get(address)
    if child is None:
        raise FacetError("facet_child_unknown", f"module {module.address!r} has no child {child_name!r}",
                         remedy="name a child module: " + ", ".join(c.rsplit(".", 1)[-1] for c in module.children[:8]),
                         module=module.address, child=child_name)
    inside = set(current_call(module).op_labels)
    for call in child.calls:
        if call.op_labels and call.op_labels[0] in inside:
            return call
    raise FacetError("facet_child_unknown", f"child {address!r} did not run inside {module.address!r}'s call",
                     remedy="the child was not called in this pass", module=module.address, child=child_name)


def call_output_spec(call: Any, recipe_id: str = "", index: int = 0) -> FacetSpec:
    """A spec whose home is the op that produced output `index` of a module call."""
    slots = call.output_slots
    if not slots:
        raise FacetError("facet_child_unknown", f"call {call.label!r} returned no tensor",
                         remedy="anchor the facet on a call that returns a tensor", call=call.label)
    label, slot = slots[index]
    return FacetSpec(home_kind="module_output", home=label, slot=slot, recipe_id=recipe_id, address=call.address,
                     call=call.call)


def child_output_spec(module: Any, child_name: str, recipe_id: str = "") -> FacetSpec:
    """Child module `child_name`'s (first) output, for the call the recipe runs for."""
    return call_output_spec(child_call(module, child_name), recipe_id)


def parameter_spec(module: Any, name: str, recipe_id: str = "") -> FacetSpec:
    """Parameter `name` of `module` (read-only: parameter facets expose no gradient)."""
    trace = module._trace
    address = name if module.address == "self" else f"{module.address}.{name}"
    if address not in trace._params:
        raise FacetError("facet_child_unknown", f"module {module.address!r} has no parameter {name!r}",
                         remedy="name one of: " + ", ".join(a.rsplit(".", 1)[-1] for a in module.param_addresses),
                         module=module.address, parameter=name)
    return FacetSpec(home_kind="parameter", home=address, recipe_id=recipe_id, address=module.address,
                     grad_capable=False)


def op_home_spec(op: Any, recipe_id: str = "", slot: int | None = None) -> FacetSpec:
    """A spec whose home is `op`'s output (an op-structural facet)."""
    return FacetSpec(home_kind="op", home=op.label, slot=slot, recipe_id=recipe_id, address=op.module)


__all__ = ["config_value", "child_output_spec", "parameter_spec", "current_call", "child_call", "call_output_spec",
           "op_home_spec", "running_for"]
