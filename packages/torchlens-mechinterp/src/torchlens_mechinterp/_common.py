"""Structural helpers shared by the kit's analysis functions: the language-model head, facet
specs read without payloads, ancestry, component naming. Nothing here reads a payload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlens.errors import MechInterpError
from torchlens.facets.view import call_entries

ADD_FUNCS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})
#: ops proposed as value-preserving when they have one tensor operand (verified on payloads)
VALUE_PRESERVING = frozenset({"view", "reshape", "contiguous", "clone", "to", "type", "float", "dropout",
                              "identity", "alias", "detach", "__getitem__", "expand_as", "view_as", "reshape_as",
                              "flatten", "squeeze", "unsqueeze"})
LINEAR_FUNCS = frozenset({"linear", "addmm", "matmul", "mm", "bmm", "baddbmm", "einsum", "conv1d", "conv2d",
                          "__matmul__"})


def entries(trace: Any, address: str) -> dict[str, Any]:
    """The facet entries (spec + status) of the single call of `address` (specs need no payloads)."""
    mod = trace._modules.get(address)
    if mod is None or not mod.calls:
        return {}
    return call_entries(mod.calls[0])


def spec_of(trace: Any, address: str, name: str) -> Any:
    e = entries(trace, address).get(name)
    return None if e is None else e.spec


def spec_labels(spec: Any) -> tuple[str, ...]:
    """The op labels a facet spec reads (a computed spec's inputs, else its home op)."""
    if spec is None or spec.home_kind == "parameter":
        return ()
    return tuple(spec.inputs) if spec.home_kind == "computed" else (spec.home,)


def lm_head(trace: Any, function: str) -> tuple[str, dict[str, Any]]:
    """(address, entries) of the one module the language_model_head recipe matched."""
    found = []
    for address, mod in trace._modules.items():
        if len(mod.calls) != 1:
            continue
        e = call_entries(mod.calls[0])
        if e.get("unembed_weight") is not None and e["unembed_weight"].spec is not None:
            found.append((address, e))
    if len(found) != 1 or found[0][1].get("final_norm_input") is None \
            or found[0][1]["final_norm_input"].spec is None:
        raise MechInterpError("mi_lm_head_unavailable", f"{function}: {len(found)} language-model heads with a "
                              "structurally found final norm in this trace; the kit needs exactly one",
                              remedy="trace a causal LM whose head (lm_head / embed_out) reads a final norm",
                              function=function, heads=[a for a, _ in found])
    return found[0]


@dataclass(frozen=True)
class HeadFacts:
    """The language-model head as the captured graph shows it: the unembedding op and its
    parameters, and the final norm found by walking up from the unembedding's input across
    shape-preserving ops to the norm module's call (never by name)."""

    head_address: str
    logits_label: str
    unembed_weight: str
    unembed_bias: str | None
    weight_layout: str  # "out_in" ([vocab, d_model], Linear) or "in_out" ([d_model, vocab], Conv1D)
    norm_address: str
    norm_kind: str  # "layer_norm" | "rms_norm"
    norm_input: str
    norm_output: str
    eps: float
    gamma: str | None
    beta: str | None
    hops: tuple[str, ...] = ()
    #: a constant the graph adds to gamma before scaling (Gemma's `(1 + weight)` RMSNorm), else 0
    gamma_offset: float = 0.0


def _gamma_offset(call: Any, gamma: str | None) -> float:
    """The float c of an op `gamma + c` inside the norm call (read from the captured graph)."""
    for op in call.ops:
        if gamma is not None and op.func_name in ADD_FUNCS and tuple(op.params) == (gamma,) and not op.parents:
            floats = [a for a in (op.args_template or ()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
            if len(floats) == 1 and not dict(op.kwargs_template or {}):
                return float(floats[0])
    return 0.0


def _norm_kind(call: Any) -> str | None:
    names = {op.func_name for op in call.ops}
    if "layer_norm" in names:
        return "layer_norm"
    if "rms_norm" in names or {"rsqrt", "mean"} <= names:
        return "rms_norm"
    return None


def _eps(call: Any, kind: str) -> float:
    ops = call._trace._ops
    for op in call.ops:
        kw = dict(op.kwargs_template or {})
        if op.func_name in ("layer_norm", "rms_norm") and "eps" in kw and kw["eps"] is not None:
            return float(kw["eps"])
        if op.func_name == "layer_norm":
            floats = [a for a in (op.args_template or ())[2:] if isinstance(a, float)]
            return floats[-1] if floats else 1e-5
        if kind == "rms_norm" and op.func_name in ADD_FUNCS and op.parents \
                and ops[op.parents[0]].func_name == "mean":
            floats = [a for a in (op.args_template or ()) if isinstance(a, float)]
            if floats:
                return floats[0]
    return 1e-5 if kind == "layer_norm" else 1e-6


def head_facts(trace: Any, function: str) -> HeadFacts:
    address, e = lm_head(trace, function)
    ops = trace._ops
    weight = e["unembed_weight"].spec.home
    bias_e = e.get("unembed_bias")
    bias = bias_e.spec.home if bias_e is not None and bias_e.spec is not None else None
    logits = next((op for op in ops.values() if weight in op.params and op.func_name in LINEAR_FUNCS), None)

    def refuse(why: str) -> MechInterpError:
        return MechInterpError("mi_lm_head_unavailable", f"{function}: {why}", remedy="trace a causal LM whose "
                               "unembedding reads a final norm's output", function=function, head=address)

    if logits is None or len(logits.parents) != 1:
        raise refuse(f"no single-input op reads the unembedding weight {weight!r}")
    cur = ops[logits.parents[0]]
    hops: list[str] = []
    while True:
        mod = trace._modules.get(cur.module) if cur.module else None
        call = next((c for c in mod.calls if cur.label in c.op_labels), None) if mod is not None else None
        kind = _norm_kind(call) if call is not None and mod is not None and mod.address != "self" else None
        if kind is not None and call.input_labels and cur.label in call.output_labels \
                and not any(o.func_name in LINEAR_FUNCS or o.func_name == "embedding" for o in call.ops):
            break
        if cur.func_name in VALUE_PRESERVING and len(cur.parents) == 1 and tuple(cur.shape or ()) == tuple(
                ops[cur.parents[0]].shape or ()):
            hops.append(cur.label)
            cur = ops[cur.parents[0]]
            continue
        raise refuse(f"the unembedding's input {logits.parents[0]!r} does not come from a norm module's output")
    params = [a for o in call.ops for a in o.params]
    gamma = next((a for a in params if len(trace._params[a].shape) == 1 and a.rsplit(".", 1)[-1] == "weight"),
                 None)
    beta = next((a for a in params if a != gamma and len(trace._params[a].shape) == 1), None)
    wshape = tuple(trace._params[weight].shape)
    d_model = ops[call.input_labels[0]].shape[-1]
    # F.linear stores [out, in]; a matmul / addmm (Conv1D-style) reads [in, out]; the shape decides otherwise
    layout = "out_in" if logits.func_name == "linear" else "in_out" if wshape[0] == d_model \
        else "out_in"
    return HeadFacts(address, logits.label, weight, bias, layout, mod.address, kind, call.input_labels[0],
                     cur.label, _eps(call, kind), gamma, beta if kind == "layer_norm" else None, tuple(hops),
                     _gamma_offset(call, gamma))


def final_norm_input_label(trace: Any, function: str) -> str:
    return head_facts(trace, function).norm_input


def attention_addresses(trace: Any) -> set[str]:
    out = set()
    for address, mod in trace._modules.items():
        for call in mod.calls:
            e = call_entries(call)
            if any(e.get(n) is not None and e[n].spec is not None for n in ("q", "z")):
                out.add(address)
                break
    return out


def mlp_addresses(trace: Any) -> set[str]:
    out = set()
    for address, mod in trace._modules.items():
        for call in mod.calls:
            e = call_entries(call)
            if e.get("pre") is not None and e["pre"].spec is not None and e.get("post") is not None:
                out.add(address)
                break
    return out


class Ancestry:
    """Ancestor sets of ops, computed on demand and cached (tensor parents only)."""

    def __init__(self, trace: Any) -> None:
        self.ops = trace._ops
        self._cache: dict[str, frozenset[str]] = {}

    def of(self, label: str) -> frozenset[str]:
        hit = self._cache.get(label)
        if hit is not None:
            return hit
        seen: set[str] = set()
        stack = list(self.ops[label].parents)
        while stack:
            lab = stack.pop()
            if lab in seen:
                continue
            seen.add(lab)
            cached = self._cache.get(lab)
            if cached is not None:
                seen |= cached
                continue
            op = self.ops.get(lab)
            if op is not None:
                stack.extend(op.parents)
        out = frozenset(seen)
        self._cache[label] = out
        return out


def component_of(module: str | None, block: str | None, attn: set[str], mlp: set[str]) -> tuple[str, str]:
    """(component module address, kind) of an op run in `module`, seen from the block `block`."""
    if module is None:
        return "", "other"
    address = module
    if block and module.startswith(block + "."):
        address = block + "." + module[len(block) + 1:].split(".")[0]
    for a in _prefixes(module):
        if a in attn:
            return a, "attn"
        if a in mlp:
            return a, "mlp"
    return address, "other"


def _prefixes(address: str) -> list[str]:
    parts = address.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def dtype_eps(*tensors: Any) -> float:
    """Machine epsilon of the coarsest floating dtype among `tensors`, float32 at the finest."""
    import torch

    eps = float(torch.finfo(torch.float32).eps)
    for t in tensors:
        if t is not None and hasattr(t, "dtype") and t.dtype.is_floating_point:
            eps = max(eps, float(torch.finfo(t.dtype).eps))
    return eps


__all__ = ["entries", "spec_of", "spec_labels", "lm_head", "final_norm_input_label", "head_facts", "HeadFacts",
           "attention_addresses",
           "mlp_addresses", "Ancestry", "component_of", "dtype_eps", "ADD_FUNCS", "VALUE_PRESERVING", "LINEAR_FUNCS"]
