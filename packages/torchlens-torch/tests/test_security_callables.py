"""Loading a torch `.tlspec` never runs code (docs/guides/security.md).

Each hostile case takes a real saved trace, writes a hostile callable name (or a `$callable`
cell) into one slot, recomputes the manifest digests as an attacker would, loads it and
runs everything that executes recorded ops: `validate_forward_pass()`, the backend's own
validation entry and a replayed intervention (`fork().do(...)`). The payloads are real: the
test checks each would write the marker file if it ran, so "no marker" means "no code ran".

The same table must re-bind what the capture records, so the second half checks that
save -> load -> `validate_forward_pass()` holds for a MaxPool CNN, `.T`/`.real`/`.mT`
property reads and direct `torch.ops.aten` calls, and that a replayed edit on the loaded
trace equals the same edit on the live one.
"""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.errors import ArtifactError, TorchLensError
from torchlens.types import CallablePlaceholder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torchlens-core" / "tests"))
from security_artifacts import (  # noqa: E402
    MARKER_NAME, add_to_dict, argref, dct, exec_source, replace_cell, rewrite_records, set_cell, tup)

OPAQUE = "opaque_op_not_replayable"


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.register_buffer("shift", torch.full((3,), 0.5))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.shift


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(2, 4)
    trace = tl.trace(model, x)
    assert list(trace.labels[1:4]) == ["linear_1_1", "relu_1_2", "linear_2_3"]
    path = trace.save(tmp_path_factory.mktemp("saved") / "mlp.tlspec")
    return path


@pytest.fixture
def art(saved, tmp_path):
    dst = tmp_path / "mlp.tlspec"
    shutil.copytree(saved, dst)
    return dst


def _run_everything(path: Path, lazy: bool = False) -> list[BaseException | None]:
    """Load, then every verb that executes recorded ops; what each raised (None: returned)."""
    loaded = tl.load(path, lazy=lazy)
    outcomes: list[BaseException | None] = []
    for action in (lambda: loaded.validate_forward_pass(),
                   lambda: loaded._backend.validate(loaded),
                   lambda: loaded.fork().do("linear_1_1", tl.scale(2.0)),
                   lambda: loaded.fork().do("input_1", tl.scale(0.5))):
        try:
            action()
            outcomes.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded and asserted on below
            outcomes.append(exc)
    return outcomes


def _assert_refused(path: Path, marker: Path, code: str = OPAQUE) -> None:
    for lazy in (False, True):
        outcomes = _run_everything(path, lazy)
        assert not marker.exists(), "a loaded artifact ran code"
        for exc in outcomes:
            assert isinstance(exc, TorchLensError) and exc.code == code, repr(exc)
            assert exc.remedy and exc.fields.get("label")


# hostile op.func names ------------------------------------------------------------------------
def _hub_repo(tmp: Path, marker: Path) -> Path:
    repo = tmp / "hubrepo"
    repo.mkdir()
    (repo / "hubconf.py").write_text(exec_source(marker) + "\ndef entry():\n    return None\n")
    return repo


class _Evil:
    def __init__(self, src: str) -> None:
        self.src = src

    def __reduce__(self):
        return (exec, (self.src,))


def _hostile_calls(tmp: Path, marker: Path) -> dict[str, tuple[dict, dict]]:
    """name -> (args cell, kwargs cell) that make that callable write the marker."""
    evil = tmp / "evil.pkl"
    evil.write_bytes(pickle.dumps(_Evil(exec_source(marker))))
    src = exec_source(marker)
    m = str(marker)
    return {
        "torch.fx.graph_module._exec_with_source": (tup(src, dct()), dct()),
        "builtins.exec": (tup(src), dct()),
        "os.system": (tup(f"touch {m}"), dct()),
        "posix.system": (tup(f"touch {m}"), dct()),
        "subprocess.getoutput": (tup(f"touch {m}"), dct()),
        "torch.hub.load": (tup(str(_hub_repo(tmp, marker)), "entry"), dct(source="local", trust_repo=True)),
        "torch.load": (tup(str(evil)), dct(weights_only=False)),
        "torch.serialization.load": (tup(str(evil)), dct(weights_only=False)),
        "torch.save": (tup(argref(0), m), dct()),
        "torch.serialization.save": (tup(argref(0), m), dct()),
        # real torch functions the capture can see, which write a file given these args
        "torch.from_file": (tup(m, True, 4), dct()),
        "torch._VariableFunctionsClass.from_file": (tup(m, True, 4), dct()),  # the pre-table name form
        "torch._C._VariableFunctions.from_file": (tup(m, True, 4), dct()),
        "torch.ops.aten.from_file": (tup(m, True, 4), dct()),
        "torch.ops.aten.from_file.default": (tup(m, True, 4), dct()),
        # jit internals, shared memory, hooks: not in the table whatever the arguments
        "torch._C._jit_set_profiling_executor": (tup(False), dct()),
        "torch.jit.load": (tup(str(evil)), dct()),
        "torch.Tensor.share_memory_": (tup(argref(0)), dct()),
        "torch.Tensor.register_hook": (tup(argref(0), {"$callable": "builtins.exec"}), dct()),
        "torch.ops.aten.__class__": (tup(argref(0)), dct()),
        "torch.ops.myns.myop": (tup(argref(0)), dct()),
    }


def test_hostile_payloads_are_real(tmp_path):
    """Control: each payload does write the marker when its callable is actually called."""
    import os
    import subprocess

    import torch.fx.graph_module as gm

    marker = tmp_path / MARKER_NAME
    calls = _hostile_calls(tmp_path, marker)
    x = torch.ones(4)
    direct = {
        "torch.fx.graph_module._exec_with_source": lambda: gm._exec_with_source(exec_source(marker), {}),
        "os.system": lambda: os.system(f"touch {marker}"),
        "subprocess.getoutput": lambda: subprocess.getoutput(f"touch {marker}"),
        "torch.hub.load": lambda: torch.hub.load(calls["torch.hub.load"][0]["$tuple"][0], "entry", source="local",
                                                 trust_repo=True),
        "torch.load": lambda: torch.load(tmp_path / "evil.pkl", weights_only=False),
        "torch.save": lambda: torch.save(x, marker),
        "torch.from_file": lambda: torch.from_file(str(marker), True, 4),
        "torch.ops.aten.from_file": lambda: torch.ops.aten.from_file(str(marker), True, 4),
    }
    for name, call in direct.items():
        assert not marker.exists()
        try:
            call()
        except Exception:  # noqa: BLE001 - torch.load unpickles (and runs) the payload, then complains
            pass
        assert marker.exists(), name
        marker.unlink()


HOSTILE_NAMES = (
    "torch.fx.graph_module._exec_with_source", "builtins.exec", "os.system", "posix.system", "subprocess.getoutput",
    "torch.hub.load", "torch.load", "torch.serialization.load", "torch.save", "torch.serialization.save",
    "torch.from_file", "torch._VariableFunctionsClass.from_file", "torch._C._VariableFunctions.from_file",
    "torch.ops.aten.from_file", "torch.ops.aten.from_file.default", "torch._C._jit_set_profiling_executor",
    "torch.jit.load", "torch.Tensor.share_memory_", "torch.Tensor.register_hook", "torch.ops.aten.__class__",
    "torch.ops.myns.myop",
)


def test_hostile_name_list_is_complete(tmp_path):
    assert set(HOSTILE_NAMES) == set(_hostile_calls(tmp_path, tmp_path / MARKER_NAME))


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_func_name_loads_opaque_and_refuses(art, tmp_path, name):
    marker = tmp_path / MARKER_NAME
    args, kwargs = _hostile_calls(tmp_path, marker)[name]

    def edit(tables):
        set_cell(tables, "ops", "relu_1_2", "func", {"$callable": name})
        set_cell(tables, "ops", "relu_1_2", "args_template", args)
        set_cell(tables, "ops", "relu_1_2", "kwargs_template", kwargs)

    rewrite_records(art, edit)
    loaded = tl.load(art)
    assert isinstance(loaded.ops["relu_1_2"].func, CallablePlaceholder)
    assert loaded.ops["relu_1_2"].func.qualname == name
    _assert_refused(art, marker)


# every other place a saved trace can hold a callable -------------------------------------------
_EXEC = {"$callable": "builtins.exec"}


def _slot_edits(marker: Path) -> dict[str, object]:
    src = exec_source(marker)
    return {
        # a replayed op would receive these: refused as opaque
        "args_template": lambda t: set_cell(t, "ops", "relu_1_2", "args_template", tup(_EXEC, src)),
        "args_template_nested": lambda t: set_cell(t, "ops", "relu_1_2", "args_template",
                                                   tup(argref(0), [dct(f=_EXEC)])),
        "kwargs_template": lambda t: set_cell(t, "ops", "relu_1_2", "kwargs_template", dct(hook=_EXEC)),
        "param_value": lambda t: replace_cell(t, "params", "fc1.weight", "value", _EXEC),
        "parent_output": lambda t: replace_cell(t, "ops", "linear_1_1", "outputs", [_EXEC]),
    }


@pytest.mark.parametrize("slot", sorted(_slot_edits(Path("/m"))))
def test_callable_cells_a_replay_would_read_are_refused(art, tmp_path, slot):
    marker = tmp_path / MARKER_NAME
    edit = _slot_edits(marker)[slot]
    rewrite_records(art, edit)
    outcomes = _run_everything(art)
    assert not marker.exists()
    for exc in outcomes:
        if slot in ("param_value", "parent_output") and exc is None:
            continue  # an edit whose cone does not read the slot replays normally
        assert isinstance(exc, TorchLensError) and exc.code == OPAQUE, (slot, repr(exc))
    assert outcomes[0] is not None and outcomes[0].code == OPAQUE


def _inert_edits() -> dict[str, object]:
    return {
        "op_meta": lambda t: add_to_dict(t, "ops", "relu_1_2", "meta", "evil", _EXEC),
        "op_grads": lambda t: set_cell(t, "ops", "relu_1_2", "grads", [_EXEC]),
        "trace_annotations": lambda t: add_to_dict(t, "trace", t["trace"]["rows"][0][0], "annotations", "evil", _EXEC),
        "provenance_extra": lambda t: add_to_dict(t, "provenance", "torch", "extra", "evil", _EXEC),
        # torch reads a buffer through its source op's payload, so its record value is inert
        "buffer_value": lambda t: replace_cell(t, "buffers", "shift", "value", _EXEC),
        "input_op_func": lambda t: set_cell(t, "ops", "input_1", "func", {"$callable": "torch.relu"}),
    }


@pytest.mark.parametrize("slot", sorted(_inert_edits()))
def test_callable_cells_nothing_executes_stay_placeholders(art, tmp_path, slot):
    """Cells no verb calls load as placeholders: the trace still validates and replays, and
    calling the placeholder refuses `callable_not_persisted`."""
    marker = tmp_path / MARKER_NAME
    rewrite_records(art, _inert_edits()[slot])
    loaded = tl.load(art)
    assert loaded.validate_forward_pass(), loaded.validation_replay_status.detail
    loaded.fork().do("linear_1_1", tl.scale(2.0))
    found = {
        "op_meta": lambda: loaded.ops["relu_1_2"].meta["evil"],
        "op_grads": lambda: loaded.ops["relu_1_2"].grads[0],
        "trace_annotations": lambda: loaded.annotations["evil"],
        "provenance_extra": lambda: loaded.provenance.extra["evil"],
        "buffer_value": lambda: loaded._buffers["shift"].value,
        "input_op_func": lambda: None,
    }[slot]()
    if found is not None:
        assert isinstance(found, CallablePlaceholder) and found.qualname == "builtins.exec"
        with pytest.raises(ArtifactError) as info:
            found(exec_source(marker))
        assert info.value.code == "callable_not_persisted"
    assert not marker.exists()


def test_opaque_op_refuses_before_any_edit_or_op_runs(art, tmp_path):
    """The replay refuses up front: a user edit staged before the opaque op never runs."""
    rewrite_records(art, lambda t: set_cell(t, "ops", "linear_2_3", "func", {"$callable": "builtins.exec"}))
    loaded = tl.load(art)
    ran = []

    def spy(v, *, ctx):
        ran.append(ctx)
        return v

    fork = loaded.fork()
    before = fork["relu_1_2"].out.clone()
    with pytest.raises(ArtifactError) as info:
        fork.do("linear_1_1", spy)
    assert info.value.code == OPAQUE and info.value.fields["label"] == "linear_2_3"
    assert ran == [] and torch.equal(fork["relu_1_2"].out, before)
    # an edit whose cone avoids the opaque op still replays
    loaded.fork().do("linear_2_3", tl.scale(2.0))


def test_rerun_on_a_loaded_trace_runs_only_the_live_model(art, tmp_path):
    """The rerun engine and `Trace.run` execute the model you pass, never a saved callable:
    with a hostile op in the artifact they still equal the same rerun of the original."""
    marker = tmp_path / MARKER_NAME
    name = "torch.fx.graph_module._exec_with_source"
    args, kwargs = _hostile_calls(tmp_path, marker)[name]

    def edit(tables):
        set_cell(tables, "ops", "relu_1_2", "func", {"$callable": name})
        set_cell(tables, "ops", "relu_1_2", "args_template", args)
        set_cell(tables, "ops", "relu_1_2", "kwargs_template", kwargs)

    rewrite_records(art, edit)
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(2, 4)  # the fixture's model and input
    original = tl.trace(model, x)
    loaded = tl.load(art)
    want = original.fork().do("linear_1_1", tl.scale(2.0), model=model, inputs=x)
    got = loaded.fork().do("linear_1_1", tl.scale(2.0), model=model, inputs=x)
    assert torch.equal(got["linear_2_3"].out, want["linear_2_3"].out)
    assert torch.equal(loaded.run(model, x, on_zero_fire="disclose")["linear_2_3"].out, original["linear_2_3"].out)
    assert not marker.exists()


def test_a_saved_name_is_never_imported(art, tmp_path, monkeypatch):
    """Resolution is a table lookup: no import happens for a name, even one of a module
    that exists on sys.path and would run code on import."""
    pkg = tmp_path / "torch_evil_pkg"
    pkg.mkdir()
    marker = tmp_path / MARKER_NAME
    (pkg / "__init__.py").write_text(exec_source(marker) + "\ndef f(*a):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torch_evil_pkg.f", "torch.torch_evil_pkg.f", "torch_evil_pkg"):
        rewrite_records(art, lambda t, name=name: set_cell(t, "ops", "relu_1_2", "func", {"$callable": name}))
        _assert_refused(art, marker)
    assert "torch_evil_pkg" not in sys.modules


# the table re-binds what the capture records --------------------------------------------------
class _MaxPoolCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 3)
        self.p1 = nn.MaxPool1d(2)
        self.c2 = nn.Conv2d(1, 4, 3)
        self.p2 = nn.MaxPool2d(2)
        self.c3 = nn.Conv3d(1, 2, 2)
        self.p3 = nn.MaxPool3d(2)
        self.head = nn.Linear(3 + 4 + 2, 5)

    def forward(self, a, b, c):
        ya = self.p1(torch.relu(self.c1(a))).amax(-1)
        yb = F.adaptive_max_pool2d(self.p2(torch.relu(self.c2(b))), 1).flatten(1)
        yc = self.p3(self.c3(c)).flatten(1)
        return self.head(torch.cat([ya, yb, yc], dim=1))


class _Properties(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        z = torch.complex(x @ self.w, x)
        y = z.real + z.imag * 2 + (x @ self.w.T).T.T
        return y.mT.mT + z.H.H.real + z.conj().imag


class _Aten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.ops.aten.relu(self.fc(x))  # an overload packet
        h = torch.ops.aten.add.Tensor(h, x)  # an overload
        h = torch.ops.aten.mul.Scalar(h, 0.5)
        return torch.ops.aten.sum.dim_IntList(torch.ops.aten.tanh.default(h), [1])


def _models():
    torch.manual_seed(0)
    return {
        "maxpool_cnn": (_MaxPoolCNN(), (torch.randn(2, 2, 9), torch.randn(2, 1, 8, 8), torch.randn(2, 1, 4, 4, 4))),
        "properties": (_Properties(), (torch.randn(3, 4),)),
        "aten": (_Aten(), (torch.randn(3, 4),)),
    }


@pytest.mark.parametrize("name", ["maxpool_cnn", "properties", "aten"])
def test_recorded_callables_round_trip_and_validate(tmp_path, name):
    model, args = _models()[name]
    trace = tl.trace(model, *args)
    assert trace.validate_forward_pass(), trace.validation_replay_status.detail
    loaded = tl.load(trace.save(tmp_path / f"{name}.tlspec"))
    for a, b in zip(trace, loaded):
        if a.func is not None:
            assert not isinstance(b.func, CallablePlaceholder), (b.label, b.func)
            assert b.func == a.func, (b.label, a.func, b.func)  # the very callable the capture recorded
    assert loaded.validate_forward_pass(), loaded.validation_replay_status.detail
    # a replayed edit on the loaded trace equals the same edit on the live trace
    site = next(op.label for op in trace if op.kind == "op")
    last = [op for op in trace if op.kind == "op"][-1].label
    live = trace.fork().do(site, tl.scale(1.5))
    again = loaded.fork().do(site, tl.scale(1.5))
    assert torch.equal(live[last].out, again[last].out)
    assert not torch.equal(live[last].out, trace[last].out)  # the edit did reach the last op


def test_saved_names_are_table_names(tmp_path):
    """The save writes the name the table resolves (no mangled pybind or boolean_dispatch name)."""
    import json

    from torchlens_torch.callables import callable_name, resolve_callable

    model, args = _models()["maxpool_cnn"]
    path = tl.trace(model, *args).save(tmp_path / "m.tlspec")
    ops = json.loads((path / "records" / "ops.json").read_bytes())
    col = ops["columns"].index("func")
    names = [r[col]["$callable"] for r in ops["rows"] if r[col] is not None]
    assert "torch.nn.functional.max_pool2d" in names and "torch.nn.functional.max_pool1d" in names
    for n in names:
        assert resolve_callable(n) is not None and callable_name(resolve_callable(n)) == n
    for fn, want in ((torch.ops.aten.relu, "torch.ops.aten.relu"), (torch.ops.aten.add.Tensor, "torch.ops.aten.add.Tensor"),
                     (torch.Tensor.T.__get__, "torch.Tensor.T.__get__"), (F.max_pool3d, "torch.nn.functional.max_pool3d")):
        assert callable_name(fn) == want and resolve_callable(want) == fn


def test_pre_table_names_still_load():
    """Artifacts saved before the table named Tensor methods and torch functions by
    `module.qualname`; those unambiguous names still resolve, to table entries only."""
    from torchlens_torch.callables import resolve_callable

    assert resolve_callable("builtins.TensorBase.add") is torch.Tensor.add
    assert resolve_callable("torch._VariableFunctionsClass.relu") is torch.relu
    assert resolve_callable("torch._C._nn.linear") is F.linear
    assert resolve_callable("builtins.getset_descriptor.__get__") is None  # ambiguous: never guessed
