"""`TorchBackend`: the torch implementation of `tl.backends.BackendProtocol`.

`capture` describes the model, snapshots its state, installs the interception
(`interceptor.CaptureMode` + global module hooks), runs the forward once, emits core's
event stream and lets core's builder make the `Trace`; then it restores the state
(pure observer) unless `carry_state=True`.

The part that touches process-global state (RNG, MHA fast-path flag, global module hooks,
the model's state snapshot) runs under `concurrency.exclusive()`: one capture or validation
replay at a time per process (see `torchlens_torch.concurrency` for the policy and for what
is detected on other threads instead).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
import warnings
from typing import Any

import torch
from torch import nn

from torchlens.backends.sdk import (
    CAPABILITY_REFUSALS, BackendCapabilities, ValidationStatus, build_trace, apply_save, save_plan,
    BackendUnsupportedError, InvalidArgumentError, TorchLensError, TraceCaptureError, CaptureOptions, TraceOptions,
    Provenance, input_paths,
)

from torchlens_torch import __version__
from torchlens_torch.concurrency import ThreadWatch, exclusive
from torchlens_torch.costs import SavedTensorTally, stamp_autograd_memory
from torchlens_torch.describe import describe_model
from torchlens_torch import module_attributes as _module_attributes
from torchlens_torch import output_names as _output_names
from torchlens_torch.interceptor import Recorder, _run_root, capture_mode, install_module_hooks, remove_module_hooks
from torchlens_torch.plugin import FRAMEWORK
from torchlens_torch.state import ModelStateSnapshot, ParamWriteGuard, RngSnapshot, seed_all
from torchlens_torch.values import copy_inputs, host_copy, iter_leaves
from torchlens_torch.weak_keep import WeakKeep

#: Top-level modules of other frameworks whose arrays are not torch inputs.
_FOREIGN_MODULES = ("jax", "jaxlib", "tensorflow", "keras", "mlx", "paddle", "tinygrad")

#: Message fragments of torch's errors for a device this build or machine lacks.
_DEVICE_ERRORS = (
    "not compiled with cuda", "found no nvidia driver", "no cuda gpus are available", "cuda driver initialization failed",
    "cuda error: no kernel image", "not compiled with mps", "mps backend is not available", "xpu is not available",
    "torch not compiled with", "no xpu devices", "cuda is not available", "cannot access accelerator device",
)

_TRACE_OPTIONS = frozenset({"save", "capture"})


class CaptureExtras:
    """Torch-only state a trace needs for its verbs (kept on the trace, never saved)."""

    __slots__ = ("backward_ready", "save_grads", "grad_store", "inference_only")

    def __init__(self, backward_ready: bool, save_grads: bool, grad_store: dict | None, inference_only: bool) -> None:
        self.backward_ready = backward_ready
        self.save_grads = save_grads
        self.grad_store = grad_store
        self.inference_only = inference_only


_DIST: list = []  # torchlens_torch.distributed, once imported (capture's lazy-arming check)


def _load_dist() -> Any:
    from torchlens_torch import distributed

    _DIST.append(distributed)
    return distributed


class TorchBackend:
    """The torch backend ("stable", eager)."""

    name = "torch"
    maturity = "stable"
    framework = FRAMEWORK
    materialization = "eager"

    # identity ---------------------------------------------------------------------------
    def capabilities(self) -> BackendCapabilities:
        return _CAPABILITIES  # frozen: one object (read several times per capture)

    def runtime_available(self) -> str | None:
        # torch is imported (this module imports it): its version cannot change in this
        # process, so the answer is computed once (it is read at every capture)
        if not _RUNTIME:
            try:
                version = self.framework.installed_version() or torch.__version__
                _RUNTIME.append(None if self.framework.contains(version) else "runtime_version_unsupported")
            except Exception:  # never raises
                return "runtime_missing"
        return _RUNTIME[0]

    def trace_options(self) -> frozenset[str]:
        return _TRACE_OPTIONS

    def refusal_codes(self) -> frozenset[str]:
        caps = self.capabilities().as_dict()
        off = {CAPABILITY_REFUSALS[k] for k, v in caps.items() if not v}
        return frozenset(off | {"trace_option_unsupported", "foreign_tensor_input", "runtime_missing",
                                "runtime_version_unsupported", "torchscript_boundary"})

    # capture ------------------------------------------------------------------------------
    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool:
        return _root_module(model) is not None

    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any:
        """The model's own forward with no TorchLens wrapper installed."""
        return model(*args, **kwargs)

    def capture(self, model: Any, args: tuple, kwargs: dict, *, save: Any = "all", capture: CaptureOptions | None = None,
                _edit_plan: Any = None, **trace_options: Any) -> Any:
        if "torch.distributed" in sys.modules:
            # SPMD processes arm lazily at capture entry (tl.distributed.arm() is the explicit route).
            # (about 1 µs per capture when torch.distributed is not initialised: the module is
            # imported once, then read from a global)
            _dist = _DIST[0] if _DIST else _load_dist()
            if _dist.armed() is None and _dist.lazy_arm() is not None:  # armed just now: re-enter the armed capture
                return self.capture(model, args, kwargs, save=save, capture=capture, _edit_plan=_edit_plan,
                                    **trace_options)
        if trace_options:
            raise BackendUnsupportedError("trace_option_unsupported",
                                          f"the torch backend does not take {', '.join(sorted(trace_options))}",
                                          remedy=f"options it takes: {', '.join(sorted(_TRACE_OPTIONS))}",
                                          options=sorted(trace_options))
        opts = capture or CaptureOptions()
        root = _root_module(model)
        if root is None:
            tname = f"{type(model).__module__}.{type(model).__qualname__}"
            raise InvalidArgumentError("model_type_unsupported", f"the torch backend traces an nn.Module or a bound method of one, not {tname}",
                                       remedy="pass the nn.Module (or model.generate-style bound method)", model_type=tname)
        _check_inputs(args, kwargs)
        plan = save_plan(save)
        if _edit_plan is not None:
            # a live (edited or structure) capture of the rerun engine, `intervene=` or a bound
            # model: run on copies, so a forward that writes its inputs in place (values or
            # requires_grad) neither changes the caller's tensors nor the next run's inputs
            args, kwargs = copy_inputs(args), copy_inputs(kwargs)
        return _Capture(self, root, model, args, kwargs, plan, opts, _edit_plan).run()

    # verbs ------------------------------------------------------------------------------
    def validate(self, trace: Any, ground_truth: Any = None, **kwargs: Any) -> ValidationStatus:
        """Replay every op from its saved inputs under its recorded RNG state and compare
        bit for bit, then perturb each float parent and check the output moves."""
        from torchlens_torch.validate import validate_trace

        with exclusive("validate"):  # replay sets the global RNG: never while another thread captures
            return validate_trace(trace, **kwargs)

    def validate_scope(self, scope: str, model: Any, args: tuple, kwargs: dict, capture: Any = None) -> Any:
        """`tl.validate(scope="receptive_field" | "intervention" | "backward")`: see
        `torchlens_torch.validate_scopes`. Returns (ValidationStatus, validation trace)."""
        from torchlens_torch.validate_scopes import run_scope

        with exclusive("validate"):
            return run_scope(scope, model, args, kwargs, capture)

    def validation_session(self, num_threads: int | None = None) -> Any:
        """Pins torch's intra-op threads for a `tl.validate` run and restores them."""
        from torchlens_torch.validate import ThreadPin

        return ThreadPin(num_threads)

    # interventions -----------------------------------------------------------------------
    def edit_ops(self) -> Any:
        from torchlens_torch.edit_ops import TorchEditOps

        return TorchEditOps()

    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any:
        from torchlens_torch.edit_ops import attach_module_edits

        return attach_module_edits(_root_module(model), rules, ops, fired)

    def resolve_callable(self, qualname: str) -> Any:
        """A saved callable name back to its torch callable, through the closed table only."""
        from torchlens_torch.callables import resolve_callable

        return resolve_callable(qualname)

    def from_host(self, values: Any, like: Any = None) -> Any:
        """A torch tensor holding `values` (numpy), with `like`'s dtype and device."""
        t = torch.as_tensor(values)
        return t.to(dtype=like.dtype, device=like.device) if isinstance(like, torch.Tensor) else t

    def backward(self, trace: Any, loss: Any, **kwargs: Any) -> Any:
        """Run `loss.backward()` and fill `op.grads` (one entry per output slot) for saved ops."""
        extras: CaptureExtras | None = trace.backend_state
        if extras is not None and extras.inference_only:
            raise InvalidArgumentError(
                "backward_inference_only",
                "this trace is an inference-only capture: its forward ran under torch.no_grad() (or "
                "CaptureOptions(inference_only=True)), so it built no autograd graph to run backward through",
                remedy="capture outside torch.no_grad(), with capture=CaptureOptions(backward_ready=True, save_grads=True)",
                inference_only=True)
        if extras is None or not extras.backward_ready:
            raise InvalidArgumentError("backward_not_requested", "this trace was not captured for a backward pass",
                                       remedy="capture with capture=CaptureOptions(backward_ready=True, save_grads=True)")
        if not isinstance(loss, torch.Tensor):
            raise InvalidArgumentError("invalid_argument", f"backward takes a tensor loss, not {type(loss).__name__}",
                                       remedy="trace.backward(trace.output.sum())")
        loss.backward(**kwargs)
        store = extras.grad_store
        if store is None:
            return None
        for op in trace._ops.values():
            slots = store.get(op.event_id)
            if slots is not None and op.saved:
                op.grads = tuple(slots) + (None,) * (len(op.shapes) - len(slots))
        return None

    # values -----------------------------------------------------------------------------
    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def host_copy(self, value: Any) -> Any:
        return host_copy(value)

    def realize_once(self, values: Any) -> Any:
        return values  # eager: values are concrete when the call returns

    def generation_driver(self) -> Any:
        """What `tl.record(..., generate_kwargs=...)` runs Hugging Face `generate()` through
        (`torchlens_torch.generation`)."""
        from torchlens_torch.generation import TorchGenerationDriver

        return TorchGenerationDriver()

    def payload_codec(self) -> Any:
        """The bit-exact torch payload codec used by `Trace.save` / `tl.load`."""
        from torchlens_torch.codec import TorchCodec

        return TorchCodec()


#: `TorchBackend.runtime_available`'s answer, once computed
_RUNTIME: list[str | None] = []

_CAPABILITIES = BackendCapabilities(
    backward_capture=True,
    fastlog=False,
    interventions=True,
    rng_replay=False,
    streaming=False,
    structure_only_capture=True,
    validation_replay=True,
    payload_materialization=True,
    intermediate_derived_grads=False,
)


def _root_module(model: Any) -> nn.Module | None:
    if isinstance(model, nn.Module):
        return model
    if inspect.ismethod(model) and isinstance(model.__self__, nn.Module):
        return model.__self__
    return None


def _check_inputs(args: tuple, kwargs: dict) -> None:
    def visit(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor) or depth > 16:
            return
        mod = type(obj).__module__.partition(".")[0]
        if mod == "numpy" and hasattr(obj, "shape"):
            raise InvalidArgumentError("input_type_unsupported", f"input {path} is a NumPy array, not a torch.Tensor",
                                       remedy="convert it with torch.as_tensor(...)", path=path, type=type(obj).__name__)
        if mod in _FOREIGN_MODULES:
            raise BackendUnsupportedError("foreign_tensor_input", f"input {path} is a {mod} value; the torch backend takes torch tensors",
                                          remedy=f"convert it to a torch.Tensor or trace with backend={mod!r}", path=path)
        if isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for k, item in obj.items():
                visit(item, f"{path}[{k!r}]", depth + 1)

    for i, a in enumerate(args):
        visit(a, f"args[{i}]", 0)
    for k, a in kwargs.items():
        visit(a, f"kwargs[{k!r}]", 0)


def _is_device_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (AssertionError, RuntimeError)) and any(frag in text for frag in _DEVICE_ERRORS)


def _make_cow_ref(opts: CaptureOptions):
    """Copy-on-write references for save_mode="copy" on the same device: a payload is
    copied only when a write is about to change its storage, or when it outlives the
    forward in an object the caller can reach (the returned output, module state)."""
    if opts.save_mode != "copy" or opts.output_device not in (None, "same"):
        return None
    return (lambda t: t.detach()) if opts.detach_saved_activations else (lambda t: t)


def _make_save_fn(opts: CaptureOptions):
    detach = opts.detach_saved_activations
    device = None if opts.output_device in (None, "same") else torch.device(opts.output_device)
    mode = opts.save_mode
    if mode == "copy":
        if device is not None:
            return (lambda t: t.detach().to(device, copy=True)) if detach else (lambda t: t.to(device, copy=True))
        return (lambda t: t.detach().clone()) if detach else (lambda t: t.clone())
    if mode == "view":
        base = lambda t: t.detach()  # noqa: E731 - aliasing stays visible
    else:  # reference
        base = (lambda t: t.detach()) if detach else (lambda t: t)
    if device is not None:
        return lambda t: base(t).to(device)
    return base


class _Capture:
    """One capture, start to finish."""

    def __init__(self, backend: TorchBackend, root: nn.Module, model: Any, args: tuple, kwargs: dict, plan: Any,
                 opts: CaptureOptions, edit_plan: Any = None) -> None:
        self.backend, self.root, self.model, self.args, self.kwargs, self.plan, self.opts = (
            backend, root, model, args, kwargs, plan, opts)
        self.edit_plan = edit_plan

    def run(self) -> Any:
        opts, root, model = self.opts, self.root, self.model
        t_start = time.perf_counter()
        wall_start = time.time()
        want_backward = opts.backward_ready or opts.save_grads
        inference_only = opts.inference_only if opts.inference_only is not None else (
            not torch.is_grad_enabled() and not want_backward)
        if inference_only:
            grad_ctx: Any = torch.no_grad()
        elif want_backward:
            grad_ctx = torch.enable_grad()
        else:
            grad_ctx = contextlib.nullcontext()

        if isinstance(model, nn.Module) or model.__func__ is getattr(type(root), "forward", None):
            fn = root
            entry = "module"
        else:
            fn = model
            entry = f"bound_method:{type(root).__qualname__}.{model.__name__}"
        pos_names, kw_names = input_paths(self.args, self.kwargs)  # core's one convention: args[i], kwargs['k']

        desc = describe_model(root)
        param_hash_quick = _param_hash_quick(root, desc)
        # (a description rebuilt from the cached walk has the same module objects: the answer is kept)
        scratch = getattr(desc, "scratch", None)
        scripted = scratch.get("scripted") if scratch is not None else None
        if scripted is None:
            script_cls = torch.jit.ScriptModule
            scripted = [addr for addr, m in desc.modules if isinstance(m, script_cls)]
            if scratch is not None:
                scratch["scripted"] = scripted
        if scripted:
            raise BackendUnsupportedError("torchscript_boundary",
                                          f"module {scripted[0]!r} is TorchScript; the ops inside it cannot be observed",
                                          remedy="trace the eager (un-scripted) module instead", modules=scripted)
        grad_store: dict | None = {} if opts.save_grads else None
        budget = opts.save_budget if isinstance(opts.save_budget, int) else None
        from torchlens.backends.sdk import take_stats_fold

        # save="stats" (issue 23): every save folds the out into its 16-slot summary as the op runs
        # (torchlens_torch.stats_fold); no copy-on-write reference keeps an out alive
        stats_fold = self.plan.kind == "all" and take_stats_fold()
        if stats_fold:
            from torchlens_torch.stats_fold import new_fold

            save_fn = new_fold()
        else:
            save_fn = _make_save_fn(opts)
        rec = Recorder(desc, save_payloads=self.plan.kind != "none", save_fn=save_fn, grad_store=grad_store,
                       check_nonfinite=None if opts.on_nonfinite == "ignore" else opts.on_nonfinite,
                       cow_ref=None if stats_fold else _make_cow_ref(opts), budget=budget)
        if stats_fold or self.plan.kind == "none":
            # nothing keeps the outs as payloads: nor does the keep list (a freed out's tag is
            # dropped instead), so intermediates are freed as the plain forward frees them
            rec.keep = WeakKeep(rec.tags)
            rec.dead = rec.keep.dead
        rec.edit_plan = self.edit_plan
        leaves: list = []
        for name, a in zip(pos_names, self.args):
            leaves.extend(iter_leaves(a, name))
        for k, a in self.kwargs.items():
            leaves.extend(iter_leaves(a, kw_names[k]))
        rec.add_inputs(leaves)  # an input over save_budget refuses here, before anything changes

        with exclusive("capture"):  # one capture at a time per process (global state below)
            threads_start = threading.active_count()
            (output, failure, writes, forward_duration, rng_at_forward, params_restored, unseen_param_writes,
             new_threads) = self._forward(rec, desc, fn, grad_ctx)
            threads_end = threading.active_count()

        t_end = time.perf_counter()
        if inference_only and opts.inference_only is None and failure is None and any(
                t.grad_fn is not None for _, t in iter_leaves(output, "output")):
            inference_only = False  # implied only: the forward turned grad back on and returned a graph
        provenance = Provenance(
            backend="torch", backend_version=__version__, framework_version=torch.__version__, kind="trace",
            model_class=type(root).__name__, start_time=wall_start, end_time=wall_start + (t_end - t_start),
            duration=t_end - t_start, root_entry_point=entry,
            extra={"rng_state": rng_at_forward, "seed": opts.seed, "forward_duration": forward_duration,
                   "outcome": "FAILED" if failure is not None else "COMPLETE",
                   "composites_expanded": rec.composite_seq, "nonfinite_events": list(rec.nonfinite_ops),
                   "owner_thread_id": rec.thread, "params_restored": params_restored,
                   "thread_count_start": threads_start, "thread_count_end": threads_end, "model_object_id": id(root),
                   "setup_duration": self._t_forward - t_start, "param_hash_quick": param_hash_quick,
                   "records_requires_grad": True},
        )
        _flag_hygiene(provenance, rec, new_threads, unseen_param_writes)
        _note_compiled(provenance, desc)
        options = TraceOptions.from_capture(
            opts, save=repr(self.plan.spec) if self.plan.kind == "select" else self.plan.kind,
            structure_only=self.plan.kind == "none", inference_only=inference_only, backward_ready=want_backward)
        if failure is not None:
            partial = build_trace(desc.info, rec.log, output=None, output_state="output_forward_failed",
                                  provenance=provenance, options=options, backend=self.backend)
            partial.annotations["partial"] = True
            raise _capture_error(failure, partial) from failure

        trace = build_trace(desc.info, rec.log, output=output, provenance=provenance, options=options,
                            backend=self.backend)
        _output_names.store(trace, getattr(self, "_output_names", None))
        # module.custom_attributes (facets); the state snapshot lets unchanged modules reuse their last record
        _module_attributes.snapshot(trace, desc.modules, getattr(self, "_state", None))
        trace.cost.forward_duration = forward_duration
        for addr, m in desc.modules:
            rec_m = trace._modules.get(addr)
            if rec_m is not None:
                rec_m._attribute_writes = writes.get(id(m), {})
        if self.plan.kind == "select":
            apply_save(trace, self.plan)
            rec.materialize_deferred(trace, getattr(self, "_deferred", None) or [])
        trace.backend_state = CaptureExtras(want_backward, opts.save_grads, grad_store, inference_only)
        # trace.autograd.grad_fns (issue 25, helper B): walk the output's grad_fn graph once, after the forward
        __import__("torchlens_torch.autograd_records").autograd_records.record_grad_fns(trace, rec, output)
        if isinstance(getattr(self, "_tally", None), SavedTensorTally):
            stamp_autograd_memory(trace, self._tally, attached=not opts.detach_saved_activations)
            provenance.extra["records_autograd_memory"] = True
        elif inference_only:  # nothing was saved for backward: zero, not unknown
            trace.cost.__dict__["_pinned"] = 0
            provenance.extra["records_autograd_memory"] = True
        if rec.nonfinite_ops and opts.on_nonfinite == "warn":
            _warn_nonfinite(trace, rec.nonfinite_ops)
        t_done = time.perf_counter()
        provenance.extra["build_duration"] = t_done - t_end
        # from the forward's end to here: hooks removed, state restored, records built
        provenance.extra["cleanup_duration"] = t_done - (self._t_forward + forward_duration)
        return trace

    def _saved_tally(self, rec: Recorder, desc: Any) -> Any:
        """Count what autograd saves for backward, only when the capture records gradients
        (the pack hook is per saved tensor; an inference capture pays nothing)."""
        opts = self.opts
        if not (opts.backward_ready or opts.save_grads):
            return contextlib.nullcontext()
        storages = set()
        for _, m in desc.modules:
            for p in m._parameters.values():
                if p is not None and p.device.type != "meta":
                    storages.add(p.untyped_storage().data_ptr())
        return SavedTensorTally(rec, storages)

    def _forward(self, rec: Recorder, desc: Any, fn: Any, grad_ctx: Any) -> tuple:
        """Run the forward with the interception installed (caller holds the capture lock).
        Every path restores what it snapshots: the model's state, parameters written in
        place, the random streams, the MHA fast-path flag and torch's global hook tables."""
        opts = self.opts
        rng = RngSnapshot()
        # restored unless carry_state; read for attribute_writes (scratch: reuses the last capture's buffer copies)
        state = self._state = ModelStateSnapshot(desc.modules, getattr(desc, "scratch", None))
        guard = ParamWriteGuard(desc.modules, desc.param_address, copy=not opts.carry_state,
                                params=[(i.address, i.value) for i in desc.info.params])
        rec.param_guard = guard
        rec.params_written = guard.written
        if opts.seed is not None:
            seed_all(opts.seed)
        rng_at_forward = rng.torch if opts.seed is None else torch.get_rng_state()  # (read only, never written)
        rec.rng_next = rng_at_forward

        fast_path = _get_mha_fastpath()
        _set_mha_fastpath(False)
        handles: list = []
        watch = ThreadWatch()
        mode = capture_mode(rec)
        failure: BaseException | None = None
        output = None
        rng_end = None
        t_forward = self._t_forward = time.perf_counter()
        try:
            handles = install_module_hooks(rec)
            handles.append(_output_names.install(rec))  # structural output names (facets), after rec's hooks
            self._output_names = handles[-1]
            tally = self._tally = self._saved_tally(rec, desc)
            with watch, grad_ctx, tally, mode:
                output = _run_root(fn, self.args, self.kwargs)
        except Exception as exc:  # the forward raised: keep the prefix as a partial trace
            failure = exc
        finally:
            forward_duration = time.perf_counter() - t_forward
            rng_end = torch.get_rng_state()
            remove_module_hooks(handles)
            _set_mha_fastpath(fast_path)
            if rec.dead:  # the tags of tensors freed at the end of the forward
                rec.keep.purge()
            try:
                if rec.pending:  # what outlives the forward must not alias a payload
                    seen: set = set()
                    if failure is None and self.plan.kind == "select":
                        # a selection keeps few payloads: module state first (the restore below
                        # writes it), then the output's pending payloads are only set aside, and
                        # copied after the build for the ops the selection keeps
                        rec.flush_modules(desc.modules, seen, state.reach_plan())
                        self._deferred = rec.defer_reachable(output, seen)
                    else:
                        if failure is None:
                            rec.flush_reachable(output, 0, seen)
                        rec.flush_modules(desc.modules, seen, state.reach_plan())  # attributes, parameters, buffers
                if failure is None and rec.budget_error is None:
                    rec.add_outputs(list(iter_leaves(output, "output")))
            finally:
                writes = state.writes()
                unseen = [] if opts.carry_state else guard.unseen_writes()
                restored = guard.restored()
                if not opts.carry_state:
                    state.restore()
                    guard.restore()
                rng.restore()
        rec.finish()
        if rec.budget_error is not None:  # also when the forward swallowed it
            failure = rec.budget_error
        if not torch.equal(rng_end, rec.rng_next):  # drawn after the last recorded random op
            rec.rng_unaccounted += 1
        return output, failure, writes, forward_duration, rng_at_forward, restored, unseen, watch.seen


_HASH_SAMPLES = 16


def sample_positions(n: int, k: int) -> list[int]:
    """`min(n, k)` evenly spaced flat positions in [0, n), first and last included (exact
    integer arithmetic: a float linspace rounds past the end above 2**24 elements)."""
    if n <= k:
        return list(range(n))
    return [i * (n - 1) // (k - 1) for i in range(k)]


def _param_hash_quick(root: nn.Module, desc: Any = None) -> str:
    """sha256 hex over each parameter's address and a per-parameter digest of its shape,
    dtype, device, requires_grad and up to `_HASH_SAMPLES` evenly spaced elements (read
    before the forward, no grad). The per-parameter digest is cached while the Parameter
    object, its version counter and its storage pointer stay the same, so a repeated
    capture of an unchanged model reads no element (an in-place update through the
    Parameter, e.g. an optimizer step, bumps its version; a write through `p.data` does not,
    so such a write is only seen once the storage is replaced or the Parameter is).

    `desc` (root's `describe_model`, taken just before) lists the same parameters under the
    same names in `named_parameters()` order, without walking the module tree again. A `desc`
    rebuilt from the cached walk (its `scratch`) has had each parameter's identity, shape, dtype,
    device and requires_grad checked against the walk that cached it: there the hash of the last
    capture is returned again while every parameter's version counter and data pointer are the
    same (the per-parameter digests' own cache key, read for all of them at once)."""
    scratch = getattr(desc, "scratch", None)
    if scratch is not None:
        values = [i.value for i in desc.info.params]
        try:
            key = [(p._version, p.data_ptr()) for p in values]
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor without data: no reuse
            key = None
        last = scratch.get("param_hash_quick")
        if key is not None and last is not None and last[0] == key:
            return last[1]
        digest = _hash_named((i.address, v) for i, v in zip(desc.info.params, values))
        if key is not None:
            scratch["param_hash_quick"] = (key, digest)
        return digest
    return _hash_named(root.named_parameters() if desc is None else ((i.address, i.value) for i in desc.info.params))


def _hash_named(named: Any) -> str:
    """`_param_hash_quick` over (address, parameter) pairs."""
    import hashlib

    h = hashlib.sha256()
    for name, p in named:
        h.update(name.encode())
        h.update(b"\0")
        h.update(_param_digest(p))
    return h.hexdigest()


#: id(Parameter) -> (weakref to it, key it was computed under, digest); an entry dies with its Parameter.
_DIGESTS: dict[int, tuple[Any, tuple, bytes]] = {}


def _param_digest(p: torch.Tensor) -> bytes:
    import hashlib
    import weakref

    key = (p._version, p.data_ptr() if p.device.type != "meta" else 0, tuple(p.shape), p.dtype, p.device,
           bool(p.requires_grad))
    hit = _DIGESTS.get(id(p))
    if hit is not None and hit[0]() is p and hit[1] == key:
        return hit[2]
    h = hashlib.sha256(repr([list(p.shape), str(p.dtype), str(p.device), bool(p.requires_grad)]).encode())
    n = p.numel()
    if n and p.device.type != "meta":
        with torch.no_grad():
            pos = sample_positions(n, _HASH_SAMPLES)
            t = p.detach()
            sample = None
            if t.device.type == "cpu" and t.is_contiguous():
                try:  # a zero-copy NumPy view: no torch op per parameter
                    sample = t.numpy().reshape(-1)[pos].tobytes()
                except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16, ...): the torch path
                    sample = None
            if sample is None:
                idx = torch.tensor(pos, dtype=torch.long, device=t.device)
                sample = t.reshape(-1).index_select(0, idx).cpu().contiguous().view(torch.uint8).numpy().tobytes()
        h.update(sample)
    digest = h.digest()
    ident = id(p)
    try:
        ref = weakref.ref(p, lambda _r, ident=ident: _DIGESTS.pop(ident, None))
    except TypeError:  # not weak-referenceable: no caching
        return digest
    _DIGESTS[ident] = (ref, key, digest)
    return digest


def _flag_hygiene(provenance: Provenance, rec: Recorder, new_threads: list[str], unseen_param_writes: list[str]) -> None:
    """Mark the trace unverified and warn (coded) for what the capture saw but could not
    record or restore: other threads' activity, unaccounted random draws, parameter writes."""
    threads = sorted(set(new_threads) | rec.foreign_threads)
    provenance.extra["thread_activity_detected"] = bool(threads)
    reasons: list[str] = []
    if threads:
        provenance.extra["foreign_threads"] = threads
        reasons.append("capture_worker_thread")
        warnings.warn(
            f"[capture_worker_thread] Python code ran on other threads during the capture ({', '.join(threads)}): "
            "torch ops run there are not recorded (their results enter the trace as constants), nor are the traced "
            "model's modules called there; run the forward's work on the calling thread to record it",
            RuntimeWarning, stacklevel=5)
    if rec.rng_unaccounted:
        provenance.extra["rng_unaccounted"] = rec.rng_unaccounted
        reasons.append("capture_rng_unaccounted")
        warnings.warn(
            "[capture_rng_unaccounted] the global random stream advanced during the capture outside its recorded "
            "random ops (another thread drew random numbers, or an op drew that TorchLens does not record as random): "
            "recorded RNG states may not replay, and restoring the caller's RNG rewound those draws; "
            "avoid drawing on other threads while capturing",
            RuntimeWarning, stacklevel=5)
    if reasons:
        provenance.verified = False
        provenance.verification_reason = reasons[0]
    if unseen_param_writes:
        provenance.extra["params_not_restored"] = list(unseen_param_writes)
        warnings.warn(
            f"[capture_state_restore_incomplete] the forward wrote parameters in place where the capture could not "
            f"see it, so it could not restore them: {', '.join(repr(a) for a in unseen_param_writes)} "
            "(a write on another thread, inside torch._C.DisableTorchFunction, or by an extension)",
            RuntimeWarning, stacklevel=5)


def _note_compiled(provenance: Provenance, desc: Any) -> None:
    """`torch.compile`d submodules ran eagerly, op by op, under the capture (the recorder is
    kept out of dynamo, see `interceptor.capture_mode`): their recorded values are eager
    kernels', which may differ in the last bits from the compiled kernels a plain call runs."""
    dynamo = sys.modules.get("torch._dynamo")
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None) if dynamo is not None else None
    if optimized is None:
        return
    compiled = [addr for addr, m in desc.modules if isinstance(m, optimized)]
    if compiled:
        provenance.extra["compiled_regions_run_eager"] = compiled
        warnings.warn(f"[capture_compiled_region_eager] the torch.compile'd module(s) {', '.join(compiled)} ran eagerly "
                      "op by op during the capture, so each op is recorded; their values are the eager kernels' and may "
                      "differ in the last bits from a plain (compiled) call", RuntimeWarning, stacklevel=4)


def _warn_nonfinite(trace: Any, events: list[int]) -> None:
    """on_nonfinite="warn": one coded warning per capture, naming how many ops and the first."""
    labels = [op.label for op in trace._ops.values() if op.event_id in set(events)]
    shown = ", ".join(labels[:5]) + (", ..." if len(labels) > 5 else "")
    warnings.warn(f"[capture_nonfinite_detected] {len(labels)} op(s) produced NaN or Inf: {shown}; "
                  "trace.nonfinite_ops lists them", RuntimeWarning, stacklevel=4)


def _capture_error(exc: BaseException, partial: Any) -> BaseException:
    if isinstance(exc, TorchLensError):
        if getattr(exc, "partial_trace", None) is None:
            exc.partial_trace = partial
        return exc
    if _is_device_error(exc):
        err = InvalidArgumentError("device_unavailable", f"the forward asked for a device this machine lacks: {exc}",
                                   remedy="move the model and its inputs to an available device (this machine: cpu)",
                                   exception_type=type(exc).__name__)
        err.partial_trace = partial
        return err
    return TraceCaptureError("forward_failed", f"the traced forward raised {type(exc).__name__}: {exc}",
                             remedy="fix the forward; exc.partial_trace holds the ops recorded before the failure",
                             partial_trace=partial, exception_type=type(exc).__name__)


def _get_mha_fastpath() -> bool | None:
    mha = getattr(torch.backends, "mha", None)
    return mha.get_fastpath_enabled() if mha is not None and hasattr(mha, "get_fastpath_enabled") else None


def _set_mha_fastpath(value: bool | None) -> None:
    mha = getattr(torch.backends, "mha", None)
    if value is not None and mha is not None and hasattr(mha, "set_fastpath_enabled"):
        mha.set_fastpath_enabled(value)


_BACKEND: TorchBackend | None = None
_LOCK = threading.Lock()


def get_backend() -> TorchBackend:
    """The process-wide torch backend object (what `BackendSpec.protocol()` returns)."""
    global _BACKEND
    with _LOCK:
        if _BACKEND is None:
            _BACKEND = TorchBackend()
        return _BACKEND
