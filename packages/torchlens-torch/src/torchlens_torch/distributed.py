"""`tl.distributed` for torch: arming, and explicit `torch.distributed` collectives recorded as
collective boundary ops (core: `torchlens.distributed`, schema `collective_boundary_v1`).

`arm()` replaces the collectives of the `torch.distributed` namespace (`all_reduce`,
`all_gather`, `all_gather_into_tensor`, `reduce_scatter`, `reduce_scatter_tensor`,
`broadcast`, `send`, `recv`, `isend`, `irecv`) with wrappers and wraps the torch backend's
`capture`; `disarm()` puts the very same objects back. Outside a capture a wrapper only counts
the call (the per-group sequence numbers every rank must agree on) and calls the original.
During a capture (the active `CaptureMode` of this thread) it runs the original with torch
function handling off (nothing inside it is recorded) and records one event through the
capture's `Recorder`, the same event path every op takes:

- a collective every member contributes to and receives from (`all_reduce`, `all_gather`,
  `all_gather_into_tensor`, `reduce_scatter_tensor`) is an op whose parents are the local
  contributions and whose outputs are what this rank received. Its recorded callable re-runs
  the real collective: validating rank traces replays it in lockstep, all ranks together,
  inside the live process group (perturbing the local contribution moves the result on every
  rank, so the ranks make the same calls). Reductions other than SUM/AVG and the list form of
  `reduce_scatter` are marked not replayable (validation refuses them typed instead of risking
  ranks that disagree on how many calls to make).
- a one-to-many message's sending side (`send`, `isend`, `broadcast` at its root) is an op of
  the sent tensor that returns it unchanged (its replay is local: what was sent);
- the receiving side (`recv`, `irecv`, `broadcast` elsewhere) is a rank-local leaf (kind
  `constant`, func_name the collective): its value came from another rank. The merge joins it
  to its sender and proves the bytes match.
- async forms (`async_op=True`, `irecv`) return a work object whose `wait()` records the
  received value (the call order fixes the sequence number).

Every boundary op carries `op.meta["collective"]` (see `torchlens.distributed.records`). A
capture that recorded a boundary is stamped `provenance.distributed_scope = "rank_local_shard"`
and every armed capture gets `provenance.extra["distributed"]` (rank, world size, run id,
arming record), which `tl.merge_ranks` reads. DDP wrappers, FSDP modules and DTensor
parameters or inputs refuse at capture entry.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import uuid
from time import perf_counter
from typing import Any, Callable

import torch
import torch.distributed as dist

import torchlens as tl
from torchlens.backends.sdk import BackendUnsupportedError, OpEvent

# core's framework-neutral records, through the public namespace (backends import core only via the SDK)
_records = tl.distributed.records
BOUNDARY_SCHEMA = _records.BOUNDARY_SCHEMA
ArmingRecord = _records.ArmingRecord
GroupIdentity = _records.GroupIdentity
digest_encoded = _records.digest_encoded
membership_digest = _records.membership_digest

from torchlens_torch.interceptor import CaptureMode, _call_site
from torchlens_torch.values import dtype_name

WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast", "send", "recv", "isend", "irecv")

_LOCK = threading.RLock()
_ORIG: dict[str, Any] = {}          # name -> the torch.distributed attribute arm() replaced
_STATE: dict[str, Any] = {"arming": None, "epoch": 0, "capture": None, "run_id": None}
_GROUPS: dict[Any, GroupIdentity] = {}   # process group object -> identity (first use order)
_ORDINALS: dict[str, int] = {}          # membership digest -> lifetimes seen
_SEQ: dict[tuple, int] = {}             # (group uid, channel) -> calls so far
_CODEC: Any = None


def _orig(name: str) -> Any:
    return _ORIG.get(name) or getattr(dist, name)


# --- arming ---------------------------------------------------------------------------------
def arm(source: str = "explicit") -> ArmingRecord:
    """Install the collective wrappers (idempotent: an armed process keeps its record)."""
    if not dist.is_available():
        raise BackendUnsupportedError("distributed_unavailable_runtime", "torch.distributed is not available in this "
                                      "torch build", remedy="install a torch build with distributed support")
    with _LOCK:
        if _STATE["arming"] is not None:
            return _STATE["arming"]
        from torchlens_torch.backend import TorchBackend

        snapshot = hashlib.sha256(("|".join(WRAPPED) + "|torch " + torch.__version__).encode()).hexdigest()[:16]
        _STATE["epoch"] += 1
        record = ArmingRecord(_STATE["epoch"], snapshot, source)
        for name in WRAPPED:
            _ORIG[name] = getattr(dist, name)
            setattr(dist, name, _WRAPPERS[name])
        _ORIG["__capture__"] = TorchBackend.__dict__["capture"]
        TorchBackend.capture = _armed_capture
        _STATE["arming"] = record
        return record


def lazy_arm() -> ArmingRecord | None:
    """Arm at capture entry (SPMD programs): only when torch.distributed is initialised and
    the process is not armed yet; returns the record, or None when nothing was armed."""
    if _STATE["arming"] is not None or not (dist.is_available() and dist.is_initialized()):
        return _STATE["arming"]
    return arm(source="lazy")


def disarm() -> None:
    """Put back exactly what `arm()` replaced; sequence counters and group identities reset."""
    with _LOCK:
        if _STATE["arming"] is None:
            return
        from torchlens_torch.backend import TorchBackend

        for name in WRAPPED:
            setattr(dist, name, _ORIG.pop(name))
        TorchBackend.capture = _ORIG.pop("__capture__")
        _STATE["arming"] = None
        _STATE["run_id"] = None
        _GROUPS.clear()
        _ORDINALS.clear()
        _SEQ.clear()


def armed() -> ArmingRecord | None:
    return _STATE["arming"]


def originals() -> dict[str, Any]:
    """The torch.distributed callables arm() replaced (empty when disarmed)."""
    return {k: v for k, v in _ORIG.items() if k in WRAPPED}


# --- capture entry / exit ---------------------------------------------------------------------
def _refuse_sharded(model: Any, args: tuple, kwargs: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel

    root = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    if isinstance(root, DistributedDataParallel):
        raise BackendUnsupportedError(
            "distributed_wrapper_unsupported", "the model is a DistributedDataParallel wrapper; its gradient "
            "all-reduce runs in backward inside DDP's reducer, not as explicit collectives",
            remedy="capture the wrapped module (tl.trace(ddp.module, x)): DDP's forward runs that module unchanged",
            wrapper="DistributedDataParallel")
    fsdp = sys.modules.get("torch.distributed.fsdp")
    dtensor_mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_mod, "DTensor", None)
    fsdp_cls = getattr(fsdp, "FullyShardedDataParallel", None)
    if isinstance(root, torch.nn.Module):
        for name, m in root.named_modules():
            if fsdp_cls is not None and isinstance(m, fsdp_cls) or type(m).__name__.startswith("FSDP"):
                _sharded(f"module {name or 'self'!r} is {type(m).__name__} (FSDP-sharded parameters)")
        if dtensor is not None:
            for name, p in root.named_parameters():
                if isinstance(p, dtensor) or isinstance(getattr(p, "data", None), dtensor):
                    _sharded(f"parameter {name!r} is a DTensor")
    if dtensor is not None:
        for i, a in enumerate(list(args) + list(kwargs.values())):
            if isinstance(a, dtensor):
                _sharded(f"input {i} is a DTensor")


def _sharded(what: str) -> None:
    raise BackendUnsupportedError(
        "distributed_sharded_state_unsupported", f"{what}: sharded state is not captured (a rank sees only its shard "
        "through DTensor/FSDP machinery, not through explicit collectives)",
        remedy="capture the unsharded model, or write the sharding by hand with explicit collectives "
               "(all_reduce/all_gather/send/recv) under tl.distributed.arm()")


def _run_id() -> str | None:
    """One id per run, shared through the default group's store: the first rank to ask
    sets it (an atomic compare-and-set), every other rank reads the same value."""
    if _STATE["run_id"] is None and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        _STATE["run_id"] = store.compare_set("torchlens/run_id", "", uuid.uuid4().hex).decode()
    return _STATE["run_id"]


def _armed_capture(self: Any, model: Any, args: tuple, kwargs: dict, **kw: Any) -> Any:
    _refuse_sharded(model, args, kwargs)
    run_id = _run_id()
    seen: list[int] = []
    prev = _STATE["capture"]
    _STATE["capture"] = seen
    try:
        trace = _ORIG["__capture__"](self, model, args, kwargs, **kw)
    finally:
        _STATE["capture"] = prev
    extra = trace.provenance.extra
    extra["distributed"] = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "run_id": run_id, "arming": _STATE["arming"].as_dict(), "boundaries": len(seen)}
    if seen:
        extra["distributed_scope"] = "rank_local_shard"
    return trace


# --- helpers --------------------------------------------------------------------------------
def _active() -> Any:
    """The recorder of this thread's active capture, or None."""
    if _STATE["capture"] is None:
        return None
    for m in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(m, CaptureMode):
            rec = m.rec
            return rec if rec.thread == threading.get_ident() else None
    return None


def _group(group: Any) -> Any:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _identity(group: Any) -> GroupIdentity:
    g = _group(group)
    ident = _GROUPS.get(g)
    if ident is None:
        ranks = tuple(dist.get_process_group_ranks(g))
        backend = str(dist.get_backend(g))
        digest = membership_digest(ranks, backend)
        ordinal = _ORDINALS.get(digest, 0)
        _ORDINALS[digest] = ordinal + 1
        ident = _GROUPS[g] = GroupIdentity(digest, ordinal, "first_use_order", ranks, backend)
    return ident


def _next(ident: GroupIdentity, channel: str) -> int:
    k = (ident.group_uid, channel)
    n = _SEQ.get(k, 0)
    _SEQ[k] = n + 1
    return n


def _group_for(group_ranks: Any) -> Any:
    """The live process group with these global ranks (None: the default group)."""
    if group_ranks is None:
        return None
    ranks = tuple(group_ranks)
    if ranks == tuple(range(dist.get_world_size())):
        return None
    for g, ident in _GROUPS.items():
        if ident.global_ranks == ranks:
            return g
    raise RuntimeError(f"no live process group with ranks {ranks} on this rank")


def _digest(t: torch.Tensor) -> str:
    global _CODEC
    if _CODEC is None:
        from torchlens_torch.codec import TorchCodec

        _CODEC = TorchCodec()
    with torch._C.DisableTorchFunction():
        enc = _CODEC.encode(t)
        return digest_encoded(enc)


def _geo(ts: list) -> list[dict[str, Any]]:
    return [{"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for t in ts]


def _op_name(op: Any) -> str:
    name = getattr(op, "name", None)
    if name is None:
        name = str(op).rpartition(".")[2]
    return str(name).lower()


_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
           "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX} if dist.is_available() else {}


def _payload(kind: str, ident: GroupIdentity, channel: str, seq: int, role: str, contributed: list, received: list,
             c_digest: list, r_digest: list, notes: list, **geo: Any) -> dict[str, Any]:
    key = {"group_uid": list(ident.group_uid), "seq": seq, "channel": channel}
    g = _group(None)
    return {
        "schema": BOUNDARY_SCHEMA, "kind": kind, "correlation_key": key,
        "rank": dist.get_rank(), "group_rank": ident.global_ranks.index(dist.get_rank()),
        "world_size": len(ident.global_ranks), "group": ident.as_dict(),
        "geometry": {"role": role, "contributed": contributed, "received": received, **geo},
        "proof": {"contributed_digest": c_digest, "received_digest": r_digest,
                  "reduce_op": geo.get("reduce_op")},
        "notes": list(notes), "lifetime": {"ordinal_source": ident.ordinal_source,
                                           "default_group_backend": str(dist.get_backend(g))},
        "arming": _STATE["arming"].as_dict(), "run_id": _STATE["run_id"],
    }


def _flush(rec: Any, t: Any) -> None:
    """Copy pending copy-on-write payloads before the collective writes `t` (not recorded)."""
    if rec.pending:
        with torch._C.DisableTorchFunction():
            rec.flush(t)


def _resolve(rec: Any, args: tuple, kwargs: dict) -> Any:
    """Parents and argument templates, read before the call (a new constant source is not an op)."""
    with torch._C.DisableTorchFunction():
        return rec._resolve_args(args, kwargs)


def _note(rec: Any, payload: dict) -> None:
    seen = _STATE["capture"]
    if seen is not None:
        seen.append(rec.next_id - 1)


def _record_op(rec: Any, kind: str, func: Callable, targs: tuple, tkwargs: dict, pre: Any, outs: tuple, multi: bool,
               inplace: bool, duration: float, payload: dict, replay_unsupported: str | None = None) -> None:
    info = rec.infos.get(func) or rec.func_info(func)
    site = _call_site(sys._getframe(3))
    out = outs if multi else outs[0]
    with torch._C.DisableTorchFunction():
        rec.record(func, info, targs, tkwargs, out, outs, multi, inplace, pre, duration, None, site)
    ev = rec.events[-1]
    ev.meta["collective"] = payload
    if replay_unsupported:
        ev.meta["replay_unsupported"] = replay_unsupported
    _note(rec, payload)


def _record_leaf(rec: Any, kind: str, t: torch.Tensor, payload: dict) -> None:
    """A received value: a rank-local leaf (kind constant, func_name the collective)."""
    _flush(rec, t)
    eid = rec._new_id()
    saved = rec.save_payloads
    with torch._C.DisableTorchFunction():
        value = rec.save_fn(t) if saved else None
    ev = OpEvent(eid, "constant", kind, (), (value,), (tuple(t.shape),), (dtype_name(t.dtype),), rec.stack,
                 None, (), None, saved)
    ev.meta["collective"] = payload
    rec.events.append(ev)
    rec.tags[id(t)] = (eid, 0)
    rec.keep.append(t)
    _note(rec, payload)


class _TracedWork:
    """An async collective's work object: `wait()` waits, then records what arrived."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish: Callable[[], None] | None = finish

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# --- replay callables (what validation re-executes) -------------------------------------------
def _replay_all_reduce(tensor: torch.Tensor, *, reduce_op: str = "sum", group_ranks: Any = None) -> torch.Tensor:
    out = tensor.clone()
    _orig("all_reduce")(out, op=_REDUCE[reduce_op], group=_group_for(group_ranks))
    return out


def _replay_all_gather(tensor: torch.Tensor, *, group_ranks: Any = None, world_size: int = 1) -> tuple:
    outs = [torch.empty_like(tensor) for _ in range(world_size)]
    _orig("all_gather")(outs, tensor, group=_group_for(group_ranks))
    return tuple(outs)


def _replay_all_gather_into_tensor(tensor: torch.Tensor, *, out_shape: Any = (), group_ranks: Any = None) -> torch.Tensor:
    out = tensor.new_empty(tuple(out_shape))
    _orig("all_gather_into_tensor")(out, tensor, group=_group_for(group_ranks))
    return out


def _replay_reduce_scatter_tensor(tensor: torch.Tensor, *, out_shape: Any = (), reduce_op: str = "sum",
                                  group_ranks: Any = None) -> torch.Tensor:
    out = tensor.new_empty(tuple(out_shape))
    _orig("reduce_scatter_tensor")(out, tensor, op=_REDUCE[reduce_op], group=_group_for(group_ranks))
    return out


def _replay_reduce_scatter(*inputs: torch.Tensor, reduce_op: str = "sum", group_ranks: Any = None) -> torch.Tensor:
    out = torch.empty_like(inputs[0])
    _orig("reduce_scatter")(out, list(inputs), op=_REDUCE[reduce_op], group=_group_for(group_ranks))
    return out


def _replay_sent(tensor: torch.Tensor, **_: Any) -> torch.Tensor:
    """The sending side of a message: the value it sent (local; the merge proves the receipt)."""
    return tensor


for _fn, _name in ((_replay_all_reduce, "all_reduce"), (_replay_all_gather, "all_gather"),
                   (_replay_all_gather_into_tensor, "all_gather_into_tensor"),
                   (_replay_reduce_scatter_tensor, "reduce_scatter_tensor"),
                   (_replay_reduce_scatter, "reduce_scatter")):
    _fn.__name__ = _name


def _sent_fn(kind: str) -> Callable:
    fn = _SENT.get(kind)
    if fn is None:
        def fn(tensor: torch.Tensor, **kw: Any) -> torch.Tensor:
            return _replay_sent(tensor, **kw)
        fn.__name__ = kind
        fn.__qualname__ = f"_replay_{kind}"
        _SENT[kind] = fn
    return fn


_SENT: dict[str, Callable] = {}


# --- wrappers ---------------------------------------------------------------------------------
def _ranks_kw(ident: GroupIdentity) -> Any:
    return None if ident.global_ranks == tuple(range(dist.get_world_size())) else list(ident.global_ranks)


def _w_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    op = dist.ReduceOp.SUM if op is None else op
    rec = _active()
    ident = _identity(group)
    seq = _next(ident, "collective")
    if rec is None:
        return _ORIG["all_reduce"](tensor, op=op, group=group, async_op=async_op)
    red = _op_name(op)
    tkw = {"reduce_op": red, "group_ranks": _ranks_kw(ident)}
    pre = _resolve(rec, (tensor,), tkw)
    c = [_digest(tensor)]
    _flush(rec, tensor)
    t0 = perf_counter()
    with torch._C.DisableTorchFunction():
        work = _ORIG["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    def finish(notes: tuple = ()) -> None:
        payload = _payload("all_reduce", ident, "collective", seq, "contributor_receiver", _geo([tensor]),
                           _geo([tensor]), c, [_digest(tensor)], list(notes), reduce_op=red)
        _record_op(rec, "all_reduce", _replay_all_reduce, (tensor,), tkw, pre, (tensor,), False, True,
                   perf_counter() - t0, payload, None if red in ("sum", "avg") else "collective_nonlinear_reduce")

    if async_op:
        return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
    finish()
    return work


def _w_all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    rec = _active()
    ident = _identity(group)
    seq = _next(ident, "collective")
    if rec is None:
        return _ORIG["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
    tkw = {"group_ranks": _ranks_kw(ident), "world_size": len(ident.global_ranks)}
    pre = _resolve(rec, (tensor,), tkw)
    c = [_digest(tensor)]
    _flush(rec, list(tensor_list))
    t0 = perf_counter()
    with torch._C.DisableTorchFunction():
        work = _ORIG["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    def finish(notes: tuple = ()) -> None:
        outs = tuple(tensor_list)
        payload = _payload("all_gather", ident, "collective", seq, "contributor_receiver", _geo([tensor]),
                           _geo(list(outs)), c, [_digest(o) for o in outs], list(notes))
        _record_op(rec, "all_gather", _replay_all_gather, (tensor,), tkw, pre, outs, True, False,
                   perf_counter() - t0, payload)

    if async_op:
        return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
    finish()
    return work


def _into(kind: str, output: Any, input: Any, op: Any, group: Any, async_op: bool) -> Any:
    """`all_gather_into_tensor` / `reduce_scatter_tensor` (op is None for the gather)."""
    reducing = op is not None
    rec = _active()
    ident = _identity(group)
    seq = _next(ident, "collective")
    call_kw: dict[str, Any] = {"group": group, "async_op": async_op}
    if reducing:
        call_kw["op"] = op
    if rec is None:
        return _ORIG[kind](output, input, **call_kw)
    red = _op_name(op) if reducing else None
    tkw: dict[str, Any] = {"out_shape": list(output.shape), "group_ranks": _ranks_kw(ident)}
    if reducing:
        tkw["reduce_op"] = red
    pre = _resolve(rec, (input,), tkw)
    c = [_digest(input)]
    _flush(rec, output)
    t0 = perf_counter()
    with torch._C.DisableTorchFunction():
        work = _ORIG[kind](output, input, **call_kw)

    def finish(notes: tuple = ()) -> None:
        geo = {"reduce_op": red} if reducing else {}
        payload = _payload(kind, ident, "collective", seq, "contributor_receiver", _geo([input]), _geo([output]),
                           c, [_digest(output)], list(notes), **geo)
        fn = _replay_reduce_scatter_tensor if reducing else _replay_all_gather_into_tensor
        bad = "collective_nonlinear_reduce" if reducing and red not in ("sum", "avg") else None
        _record_op(rec, kind, fn, (input,), tkw, pre, (output,), False, False, perf_counter() - t0, payload, bad)

    if async_op:
        return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
    finish()
    return work


def _w_all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    return _into("all_gather_into_tensor", output_tensor, input_tensor, None, group, async_op)


def _w_reduce_scatter_tensor(output: Any, input: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    return _into("reduce_scatter_tensor", output, input, dist.ReduceOp.SUM if op is None else op, group, async_op)


def _w_reduce_scatter(output: Any, input_list: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    op = dist.ReduceOp.SUM if op is None else op
    rec = _active()
    ident = _identity(group)
    seq = _next(ident, "collective")
    if rec is None:
        return _ORIG["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)
    red = _op_name(op)
    tkw = {"reduce_op": red, "group_ranks": _ranks_kw(ident)}
    inputs = tuple(input_list)
    pre = _resolve(rec, inputs, tkw)
    c = [_digest(t) for t in inputs]
    _flush(rec, output)
    t0 = perf_counter()
    with torch._C.DisableTorchFunction():
        work = _ORIG["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)

    def finish(notes: tuple = ()) -> None:
        payload = _payload("reduce_scatter", ident, "collective", seq, "contributor_receiver", _geo(list(inputs)),
                           _geo([output]), c, [_digest(output)], list(notes), reduce_op=red)
        # a rank's output depends on one entry of its list only: a perturbation check would make
        # the ranks disagree on how many calls to replay, so validation refuses it typed
        _record_op(rec, "reduce_scatter", _replay_reduce_scatter, inputs, tkw, pre, (output,), False, False,
                   perf_counter() - t0, payload, "collective_list_reduce_scatter")

    if async_op:
        return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
    finish()
    return work


def _peer(rank: Any, group: Any, group_rank: Any) -> int:
    if rank is not None:
        return int(rank)
    return dist.get_global_rank(_group(group), group_rank)


def _record_sent(rec: Any, kind: str, tensor: Any, ident: GroupIdentity, channel: str, seq: int, notes: list,
                 t0: float, c: list, **geo: Any) -> None:
    tkw = {"group_ranks": _ranks_kw(ident)}
    pre = _resolve(rec, (tensor,), tkw)
    role = "root" if kind == "broadcast" else "sender"
    payload = _payload(kind, ident, channel, seq, role, _geo([tensor]), [], c, [], notes, **geo)
    _record_op(rec, kind, _sent_fn(kind), (tensor,), tkw, pre, (tensor,), False, False, perf_counter() - t0, payload)


def _w_send_like(kind: str) -> Callable:
    def wrapper(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None) -> Any:
        rec = _active()
        ident = _identity(group)
        me = dist.get_rank()
        to = _peer(dst, group, group_dst)
        channel = f"p2p:{me}->{to}"
        seq = _next(ident, channel)
        call = _ORIG[kind]
        if rec is None:
            return call(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        c = [_digest(tensor)]
        t0 = perf_counter()
        with torch._C.DisableTorchFunction():
            work = call(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        notes = ["async: the value at the isend call"] if kind == "isend" else []
        _record_sent(rec, kind, tensor, ident, channel, seq, notes, t0, c, peer=to, tag=tag)
        return work

    wrapper.__name__ = kind
    return wrapper


def _w_recv_like(kind: str) -> Callable:
    def wrapper(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None) -> Any:
        rec = _active()
        ident = _identity(group)
        me = dist.get_rank()
        if src is None and group_src is None:
            if rec is not None:
                raise BackendUnsupportedError(
                    "distributed_collective_unsupported", f"{kind} from any source during a capture: the message "
                    "cannot be correlated before it arrives", remedy=f"pass src= to {kind}")
            return _ORIG[kind](tensor, src=src, group=group, tag=tag, group_src=group_src)
        frm = _peer(src, group, group_src)
        channel = f"p2p:{frm}->{me}"
        seq = _next(ident, channel)
        call = _ORIG[kind]
        if rec is None:
            return call(tensor, src=src, group=group, tag=tag, group_src=group_src)
        _flush(rec, tensor)
        with torch._C.DisableTorchFunction():
            work = call(tensor, src=src, group=group, tag=tag, group_src=group_src)

        def finish(notes: tuple = ()) -> None:
            payload = _payload(kind, ident, channel, seq, "receiver", [], _geo([tensor]), [], [_digest(tensor)],
                               list(notes), peer=frm, tag=tag)
            _record_leaf(rec, kind, tensor, payload)

        if kind == "irecv":
            return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
        finish()
        return work

    wrapper.__name__ = kind
    return wrapper


def _w_broadcast(tensor: Any, src: Any = None, group: Any = None, async_op: bool = False, group_src: Any = None) -> Any:
    rec = _active()
    ident = _identity(group)
    seq = _next(ident, "collective")
    if rec is None:
        return _ORIG["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    root = _peer(src, group, group_src)
    me = dist.get_rank()
    t0 = perf_counter()
    if me == root:
        c = [_digest(tensor)]
        with torch._C.DisableTorchFunction():
            work = _ORIG["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
        _record_sent(rec, "broadcast", tensor, ident, "collective", seq, [], t0, c, root=root)
        return work
    _flush(rec, tensor)
    with torch._C.DisableTorchFunction():
        work = _ORIG["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)

    def finish(notes: tuple = ()) -> None:
        payload = _payload("broadcast", ident, "collective", seq, "receiver", [], _geo([tensor]), [],
                           [_digest(tensor)], list(notes), root=root)
        _record_leaf(rec, "broadcast", tensor, payload)

    if async_op:
        return _TracedWork(work, lambda: finish(("async: recorded at wait()",)) if _active() is rec else None)
    finish()
    return work


_WRAPPERS: dict[str, Callable] = {
    "all_reduce": _w_all_reduce, "all_gather": _w_all_gather,
    "all_gather_into_tensor": _w_all_gather_into_tensor,
    "reduce_scatter_tensor": _w_reduce_scatter_tensor, "reduce_scatter": _w_reduce_scatter,
    "broadcast": _w_broadcast, "send": _w_send_like("send"), "isend": _w_send_like("isend"),
    "recv": _w_recv_like("recv"), "irecv": _w_recv_like("irecv"),
}

__all__ = ["arm", "lazy_arm", "disarm", "armed", "originals", "WRAPPED"]
