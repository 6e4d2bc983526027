"""The five acceptance checks of the real-model zoo, shared by the tests and the benchmark.

Per model (issue 12, acceptance): the trace's output equals the model's own output bit for
bit; `validate` is True; every module's outputs equal what an independent forward hook saw;
save/load then validate is True; a replay zero-ablation at a mid-model module equals a
forward-hook ablation. Each check returns a `Check(ok, detail)` so the benchmark can print a
table and a test can assert with the detail as its message. Oracles never use TorchLens.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import torchlens as tl
from torchlens.backends.sdk import TorchLensError
from torchlens_torch.real_zoo import ENTRIES, RealEntry
from torchlens_torch.testing import mha_fastpath_disabled, tensor_leaves


@dataclass
class Check:
    ok: bool | None  # None: not applicable to this model
    detail: str = ""

    def __bool__(self) -> bool:
        return bool(self.ok)


@dataclass
class Case:
    """One built model and its capture (shared by every check of that model)."""

    entry: RealEntry
    model: Any
    args: tuple
    kwargs: dict
    trace: Any = None
    error: str = ""
    capture_s: float = 0.0
    plain_s: float = 0.0


def _plain(case: Case, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    with mha_fastpath_disabled():
        return case.model(*case.args, **case.kwargs)


def capture(name: str, seed: int = 0) -> Case:
    """Build `name` with `seed` and trace it (seeded like the plain runs it is compared to)."""
    entry = ENTRIES[name]
    model, args, kwargs = entry.build(seed)
    case = Case(entry, model, args, kwargs)
    t0 = time.perf_counter()
    _plain(case)
    case.plain_s = time.perf_counter() - t0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            t0 = time.perf_counter()
            case.trace = tl.trace(model, *args, input_kwargs=kwargs)
            case.capture_s = time.perf_counter() - t0
    except Exception as exc:  # reported, not hidden: every check then fails with this text
        case.error = f"{type(exc).__name__}: {exc}"[:300]
    return case


def _equal(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and a.dtype == b.dtype and torch.equal(a, b)


def output_exact(case: Case) -> Check:
    if case.trace is None:
        return Check(False, f"trace failed: {case.error}")
    want = tensor_leaves(_plain(case))
    got = tensor_leaves(case.trace.output)
    if len(got) != len(want) or not all(_equal(a, b) for a, b in zip(got, want)):
        return Check(False, f"trace.output differs ({len(got)} vs {len(want)} leaves)")
    outs = [o.out for o in case.trace.output_ops]
    if len(outs) != len(want) or not all(_equal(a, b) for a, b in zip(outs, want)):
        return Check(False, f"output_ops hold {len(outs)} values, the model returned {len(want)} tensors")
    return Check(True)


def _status(trace: Any) -> str:
    s = trace.validation_replay_status
    return f"{getattr(s, 'reason', None)} at {getattr(s, 'first_failure', None)}: {getattr(s, 'detail', '')}"[:300]


class _CountTorchCalls(torch.overrides.TorchFunctionMode):
    """Counts every torch function call made while it is active (independent of TorchLens)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def refuses_typed(code: str, call: Any) -> Check:
    """`call()` must raise a TorchLensError with `code` before any torch op ran (the model's
    promise for this check is a typed refusal, not a verdict)."""
    counter = _CountTorchCalls()
    try:
        with counter:
            call()
    except TorchLensError as exc:
        if exc.code != code:
            return Check(False, f"refused with {exc.code!r}, expected {code!r}: {exc}"[:300])
        if counter.calls:
            return Check(False, f"refused {code} only after running {len(counter.calls)} torch ops "
                                f"({counter.calls[:3]})")
        return Check(True, f"refused {code} before any op ran")
    except Exception as exc:
        return Check(False, f"raised {type(exc).__name__} (untyped), expected {code!r}: {exc}"[:300])
    return Check(False, f"did not refuse; expected {code!r}")


def validates(case: Case) -> Check:
    if case.trace is None:
        return Check(False, f"trace failed: {case.error}")
    code = case.entry.refusal("validate")
    if code is not None:
        return refuses_typed(code, case.trace.validate_forward_pass)
    try:
        ok = case.trace.validate_forward_pass()
    except Exception as exc:
        return Check(False, f"raised {type(exc).__name__}: {exc}"[:300])
    return Check(ok, "" if ok else _status(case.trace))


def _call_values(call: Any) -> list[torch.Tensor]:
    values: list[torch.Tensor] = []
    for op in call.output_ops:
        values.extend(t for t in (op.outs if op.multi_output else (op.out,)) if isinstance(t, torch.Tensor))
    return values


def module_outputs_match_hooks(case: Case) -> Check:
    """Every tensor a forward hook saw leave a module is among that module call's outputs."""
    if case.trace is None:
        return Check(False, f"trace failed: {case.error}")
    seen: dict[str, list[list[torch.Tensor]]] = {}
    handles = []
    for name, mod in case.model.named_modules():
        addr = name or "self"

        def hook(m: Any, inp: Any, out: Any, addr: str = addr) -> None:
            seen.setdefault(addr, []).append([t.detach().clone() for t in tensor_leaves(out)])

        handles.append(mod.register_forward_hook(hook))
    try:
        _plain(case)
    finally:
        for h in handles:
            h.remove()
    checked = 0
    for addr, calls in seen.items():
        if addr not in case.trace.modules:
            return Check(False, f"module {addr} ran but is not in the trace")
        module = case.trace.modules[addr]
        if module.num_calls != len(calls):
            return Check(False, f"{addr}: {module.num_calls} calls recorded, hooks saw {len(calls)}")
        for call, expected in zip(module.calls, calls):
            got = _call_values(call)
            for i, leaf in enumerate(expected):
                if not any(_equal(g, leaf) for g in got):
                    return Check(False, f"{call.label}: output {i} {tuple(leaf.shape)} {leaf.dtype} missing "
                                        f"(recorded {[tuple(g.shape) for g in got]})")
                checked += 1
    return Check(checked > 0, f"{checked} module outputs compared")


def save_load_validates(case: Case) -> Check:
    if case.trace is None:
        return Check(False, f"trace failed: {case.error}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.tlspec"
        try:
            case.trace.save(path)
            loaded = tl.load(path)
            code = case.entry.refusal("save_load_validate")
            if code is not None:
                return refuses_typed(code, loaded.validate_forward_pass)
            ok = loaded.validate_forward_pass()
        except Exception as exc:
            return Check(False, f"raised {type(exc).__name__}: {exc}"[:300])
    return Check(ok, "" if ok else _status(loaded))


def _zero(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return torch.zeros_like(out)
    if isinstance(out, tuple):
        return tuple(_zero(o) for o in out)
    if isinstance(out, dict):  # an OrderedDict of feature maps (torchvision's FPN)
        return type(out)((k, _zero(v)) for k, v in out.items())
    return out


def ablation_matches_hook(case: Case) -> Check:
    """`fork().do(module(site), zero_ablate())` replayed == a forward hook returning zeros."""
    site = case.entry.site
    if site is None:
        return Check(None, case.entry.note)
    if case.trace is None:
        return Check(False, f"trace failed: {case.error}")
    handle = case.model.get_submodule(site).register_forward_hook(lambda m, i, o: _zero(o))
    try:
        want = tensor_leaves(_plain(case))
    finally:
        handle.remove()
    code = case.entry.refusal("ablation")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if code is not None:  # replay must refuse typed; the rerun engine must give the hook's answer
                try:
                    case.trace.fork().do(tl.module(site), tl.zero_ablate())
                    return Check(False, f"replay did not refuse; expected {code!r}")
                except TorchLensError as exc:
                    if exc.code != code:
                        return Check(False, f"replay refused with {exc.code!r}, expected {code!r}: {exc}"[:300])
                torch.manual_seed(0)
                with mha_fastpath_disabled():
                    fork = case.trace.fork().do(tl.module(site), tl.zero_ablate(), model=case.model,
                                                inputs=case.args, input_kwargs=case.kwargs or None)
            else:
                fork = case.trace.fork().do(tl.module(site), tl.zero_ablate())
    except Exception as exc:
        return Check(False, f"raised {type(exc).__name__}: {exc}"[:300])
    got = [o.out for o in fork.output_ops]
    if len(got) != len(want):
        return Check(False, f"{len(got)} outputs after replay, {len(want)} from the hooked model")
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not _equal(a, b)]
    if bad:
        a, b = got[bad[0]], want[bad[0]]
        diff = (a.double() - b.double()).abs().max().item() if isinstance(a, torch.Tensor) and a.shape == b.shape \
            and not a.is_complex() else "shape/dtype"
        return Check(False, f"output {bad[0]} differs from the hook ablation (max |diff| {diff})")
    return Check(True)


CHECKS = {
    "output_exact": output_exact,
    "validate": validates,
    "module_hooks": module_outputs_match_hooks,
    "save_load_validate": save_load_validates,
    "ablation": ablation_matches_hook,
}

__all__ = ["Check", "Case", "capture", "CHECKS", "refuses_typed", "output_exact", "validates", "module_outputs_match_hooks",
           "save_load_validates", "ablation_matches_hook"]
