"""The reference backend: records the reference framework's ops as core events.

Written on `torchlens.backends.sdk` only (the dependency test checks it): it is the model a
third-party backend copies.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from torchlens.backends.sdk import (
    ArgRef,
    BackendCapabilities,
    EventLog,
    InvalidArgumentError,
    ModelInfo,
    ModuleEnter,
    ModuleExit,
    ModuleInfo,
    OpEvent,
    ParamInfo,
    Provenance,
    TraceCaptureError,
    positional_path,
    ValidationStatus,
    apply_save,
    build_trace,
    check_requested_capabilities,
    refusal_codes_for,
    save_plan,
)
from torchlens_reference import nn, runtime
from torchlens_reference.plugin import FRAMEWORK

_CALL_CODE = nn.Module.__call__.__code__


class _Recorder:
    def __init__(self, model: nn.Module, log: EventLog) -> None:
        self.log = log
        self.addr_of = {id(m): (a or "self") for a, m in model.named_modules()}
        self.param_addr = {id(p): a for a, p in model.named_parameters()}
        self.param_value_addr = {id(p.value): a for a, p in model.named_parameters()}
        self.producer: dict[int, tuple[int, int]] = {}
        self.alive: list[Any] = []  # keeps ids stable during the capture
        self.stack: list[tuple[str, int]] = []
        self.calls: dict[str, int] = {}
        self.edit_plan: Any = None

    def source(self, kind: str, value: np.ndarray, path: str) -> int:
        i = self.log.new_id()
        self.log.append(OpEvent(i, kind, kind, outputs=(value.copy(),), shapes=(value.shape,), dtypes=(str(value.dtype),),
                                path=path, module_stack=tuple(self.stack) if kind == "constant" else ()))
        self.producer[id(value)] = (i, 0)
        self.alive.append(value)
        return i

    def op(self, name: str, fn: Any, args: tuple, out: np.ndarray, params: tuple, meta: dict | None = None) -> None:
        parents: list[tuple[int, int]] = []
        template: list[Any] = []
        param_addrs = [self.param_addr[id(p)] for p in params if id(p) in self.param_addr]
        for a in args:
            if isinstance(a, np.ndarray):
                if id(a) in self.param_value_addr:
                    template.append(ArgRef(address=self.param_value_addr[id(a)]))
                    continue
                src = self.producer.get(id(a))
                if src is None:
                    self.source("constant", a, "constant")
                    src = self.producer[id(a)]
                template.append(ArgRef(index=len(parents)))
                parents.append(src)
            else:
                template.append(a)
        i = self.log.new_id()
        if self.edit_plan is not None and i in self.edit_plan:
            out = self.edit_plan.apply(i, (out,))[0]
        out_arr = np.asarray(out)
        self.log.append(OpEvent(
            i, "op", name, parents=tuple(parents), outputs=(out_arr.copy(),), shapes=(out_arr.shape,),
            dtypes=(str(out_arr.dtype),), module_stack=tuple(self.stack), site=_site(), params=tuple(param_addrs),
            func=fn, args_template=tuple(template), meta=meta or {}))
        self.producer[id(out)] = (i, 0)
        self.alive.append(out)
        return out

    def enter(self, module: nn.Module, args: tuple) -> None:
        addr = self.addr_of.get(id(module), f"<unregistered {type(module).__name__}>")
        n = self.calls.get(addr, 0) + 1
        self.calls[addr] = n
        self.stack.append((addr, n))
        ins = tuple(self.producer[id(a)] for a in args if isinstance(a, np.ndarray) and id(a) in self.producer)
        self.log.append(ModuleEnter(addr, n, ins))

    def exit(self, module: nn.Module, out: Any) -> None:
        addr, n = self.stack.pop()
        outs = tuple(self.producer[id(o)] for o in _leaves(out) if id(o) in self.producer)
        self.log.append(ModuleExit(addr, n, outs))


def _site() -> tuple:
    """(code, instruction) pairs from the op call up to the innermost module's __call__."""
    f = sys._getframe(3)
    key = []
    while f is not None and f.f_code is not _CALL_CODE and len(key) < 16:
        key.append((f.f_code, f.f_lasti))
        f = f.f_back
    return tuple(key)


def _leaves(obj: Any, path: str = "output") -> list[Any]:
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in _leaves(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _leaves(o)]
    return []


def _paths(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, np.ndarray):
        return [(path, obj)]
    if isinstance(obj, (tuple, list)):
        return [x for i, o in enumerate(obj) for x in _paths(o, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [x for k, o in obj.items() for x in _paths(o, f"{path}[{k!r}]")]
    return []


class ReferenceBackend:
    """BackendProtocol implementation for the reference framework."""

    name = "reference"
    maturity = "preview"
    framework = FRAMEWORK
    materialization = "eager"
    _OPTIONS = frozenset({"save", "capture"})

    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(validation_replay=True, payload_materialization=True, interventions=True)

    def edit_ops(self) -> Any:
        from torchlens_reference.edit_ops import ReferenceEditOps

        return ReferenceEditOps()

    def resolve_callable(self, qualname: str) -> Any:
        """Saved op callables come back only from the reference framework's own ops."""
        prefix = "torchlens_reference.ops."
        if not qualname.startswith(prefix):
            return None
        from torchlens_reference import ops

        f = getattr(ops, qualname[len(prefix):], None)
        return f if callable(f) and getattr(f, "__module__", "") == "torchlens_reference.ops" else None

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        """Bound-executor hooks: edit module outputs as the modules return."""
        from torchlens.backends.sdk import HookContext

        addr_of = {id(m): (a or "self") for a, m in model.named_modules()}
        calls: dict[str, int] = {}

        def on_exit(module: Any, out: Any) -> Any:
            addr = addr_of.get(id(module))
            n = calls[addr] = calls.get(addr, 0) + 1
            for i, (address, call, edit) in enumerate(rules):
                if address == addr and (call is None or call == n) and isinstance(out, np.ndarray):
                    out = edit(out, HookContext(f"{addr}:{n}", None, None, ops))
                    fired[i] = fired.get(i, 0) + 1
            return out

        return runtime.push_exit_hook(on_exit)

    def runtime_available(self) -> str | None:
        return None

    def trace_options(self) -> frozenset[str]:
        return self._OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        return refusal_codes_for(self)

    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        return isinstance(model, nn.Module)

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def host_copy(self, value: Any) -> np.ndarray:
        return np.array(value, copy=True)

    def realize_once(self, values: Any) -> Any:
        return values

    def payload_codec(self) -> Any:
        """Payloads are numpy arrays: core's generic numpy codec saves and loads them."""
        from torchlens.backends.sdk import NumpyCodec

        return NumpyCodec()

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        return model(*args, **kwargs)

    def capture(self, model: Any, args: tuple, kwargs: dict, save: Any = "all", capture: Any = None, _edit_plan: Any = None,
                **options: Any) -> Any:
        # the same pre-capture refusals tl.trace makes, for callers that reach capture directly
        check_requested_capabilities(self, capture, options)
        plan = save_plan(save)
        for i, a in enumerate(args):
            if not isinstance(a, np.ndarray):
                raise InvalidArgumentError("input_type_unsupported", f"input {i} is a {type(a).__name__}, not a numpy array",
                                           remedy="pass numpy arrays", index=i)
        log = EventLog()
        rec = _Recorder(model, log)
        rec.edit_plan = _edit_plan
        info = ModelInfo(type(model).__name__)
        for addr, m in model.named_modules():
            a = addr or "self"
            info.modules.append(ModuleInfo(a, type(m).__name__, type(m).__qualname__, training=m.training))
        for addr, p in model.named_parameters():
            mod, _, name = addr.rpartition(".")
            info.params.append(ParamInfo(addr, mod or "self", name, p.value.shape, str(p.value.dtype), p.trainable, p.value))
        for i, a in enumerate(args):
            rec.source("input", a, positional_path(i))  # core's one convention (sdk.input_paths)
        start = time.perf_counter()
        prov = Provenance("reference", backend_version="0.1.0", framework_version=np.__version__,
                          model_class=type(model).__name__, start_time=time.time())
        runtime.RECORDER = rec
        try:
            rec.enter(model, args)
            try:
                out = model.forward(*args, **kwargs)
            finally:
                runtime.RECORDER = None
            rec.exit(model, out)
        except Exception as exc:
            partial = build_trace(info, log, output_state="output_forward_failed", provenance=prov, backend=self)
            raise TraceCaptureError("forward_failed", f"the forward raised {type(exc).__name__}: {exc}",
                                    remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                                    partial_trace=partial) from exc
        for path, leaf in _paths(out, "output"):
            src = rec.producer.get(id(leaf))
            i = log.new_id()
            log.append(OpEvent(i, "output", "output", parents=(src,) if src else (), outputs=(leaf.copy(),),
                               shapes=(leaf.shape,), dtypes=(str(leaf.dtype),), path=path))
        prov.duration = time.perf_counter() - start
        prov.end_time = time.time()
        trace = build_trace(info, log, output=out, provenance=prov, options=capture, backend=self)
        apply_save(trace, plan)
        return trace

    def validate(self, trace: Any, ground_truth: Any = None) -> ValidationStatus:
        """Replay every op on its parents' saved values through core's replay engine and
        compare with its saved output (the edit ops restore each op's recorded RNG state)."""
        from torchlens.backends.sdk import replay_validate
        from torchlens_reference.edit_ops import ReferenceEditOps

        return replay_validate(trace, ReferenceEditOps(),
                               ground_truth=None if ground_truth is None else [np.asarray(g) for g in _leaves(ground_truth)])
