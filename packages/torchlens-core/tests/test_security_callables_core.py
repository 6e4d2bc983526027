"""Loading never runs code, for every callable slot of every record schema (core side, with
the framework-free reference backend; docs/guides/security.md).

Every column a saved trace can hold a callable in (the `callable` column `ops.func`, and
every `value`/`values` column, where a `$callable` cell may sit) is found from
`torchlens.io.schema.SCHEMAS`, so a column added later is covered. Each case writes a hostile
name there, recomputes the manifest digests as an attacker would, loads the artifact and runs
every verb that executes recorded ops. The marker file must never appear; a slot a replay
would read must refuse with `opaque_op_not_replayable` (typed, before anything runs); any
other slot stays an inert `CallablePlaceholder`. Saved recipes and intervention specs hold
placeholders for user code: those refuse too, and a hostile helper name never rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, TorchLensError
from torchlens.io.schema import SCHEMAS
from torchlens.types import CallablePlaceholder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from security_artifacts import MARKER_NAME, cell, exec_source, rewrite_records, tup  # noqa: E402

OPAQUE = "opaque_op_not_replayable"
HOSTILE = "os.system"
#: (record kind, row) each column is attacked in: relu_1_2 is replayed by every verb below.
_ROW = {"ops": "relu_1_2", "params": "0.weight", "trace": "root", "provenance": "reference", "cost": None}
#: Slots a replay reads (the op's callable, its arguments, a parameter it reads, a parent output).
_REPLAYED = {("ops", "func"), ("ops", "args_template"), ("ops", "kwargs_template"), ("params", "value"),
             ("ops", "outputs")}
_SLOTS = [(kind, col, ctype) for kind, cols in SCHEMAS.items() for col, ctype in cols
          if ctype in ("callable", "value", "values", "values?")]


def test_the_slot_list_covers_every_callable_column():
    kinds = {k for k, _, _ in _SLOTS}
    # buffers: the reference zoo has no buffer; the torch suite attacks buffers.value
    assert kinds - {"buffers"} <= set(_ROW) and ("ops", "func", "callable") in _SLOTS
    assert len(_SLOTS) >= 11


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from torchlens_reference.zoo import zoo

    e = zoo()["mlp"]
    trace = tl.trace(e["model"], *e["args"])
    assert list(trace.labels) == ["input_1", "linear_1_1", "relu_1_2", "linear_2_3", "output_1"]
    assert trace.validate_forward_pass()
    return trace.save(tmp_path_factory.mktemp("ref") / "mlp.tlspec")


@pytest.fixture
def art(saved, tmp_path):
    dst = tmp_path / "mlp.tlspec"
    shutil.copytree(saved, dst)
    return dst


def _row_label(tables, kind):
    return _ROW[kind] if _ROW[kind] is not None else tables[kind]["rows"][0][0]


def _inject(tables, kind, col, ctype, marker):
    """Put a hostile `$callable` into one cell, keeping every payload it referenced."""
    evil = {"$callable": HOSTILE}
    row, i = cell(tables, kind, _row_label(tables, kind), col)
    old = row[i]
    if ctype == "callable":
        row[i] = evil
        a = tables[kind]["columns"].index("args_template")
        row[a] = tup(f"touch {marker}")  # the call os.system would make
        return
    if isinstance(old, dict) and "$dict" in old:
        old["$dict"].append(["evil", evil])
        return
    if ctype == "values" or (ctype == "values?" and old):
        row[i] = [evil] + list(old[1:])
        kept = old[:1]
    else:
        row[i] = [evil] if ctype == "values?" else tup(evil, exec_source(marker))
        kept = [old]
    if "$payload" in json.dumps(kept):  # keep the payload referenced (no orphan record)
        trow = tables["trace"]["rows"][0]
        trow[tables["trace"]["columns"].index("annotations")]["$dict"].append([f"kept_{kind}_{col}", kept])


def _placeholders(obj, depth=0):
    if isinstance(obj, CallablePlaceholder):
        yield obj
    elif depth < 20 and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _placeholders(v, depth + 1)
    elif depth < 20 and isinstance(obj, dict):
        for v in obj.values():
            yield from _placeholders(v, depth + 1)


def _all_cells(loaded):
    for op in loaded._ops.values():
        yield [op.func, op.args_template, op.kwargs_template, op.meta, op._outputs, op.grads]
    for p in loaded._params.values():
        yield p.value
    yield [loaded.options, loaded.annotations, loaded.provenance.extra, loaded.cost.macs_by_kind]


@pytest.mark.parametrize("kind,col,ctype", [s for s in _SLOTS if s[0] != "buffers"],
                         ids=[f"{k}.{c}" for k, c, _ in _SLOTS if k != "buffers"])
def test_every_callable_slot_never_runs_code(art, tmp_path, kind, col, ctype):
    marker = tmp_path / MARKER_NAME
    rewrite_records(art, lambda t: _inject(t, kind, col, ctype, marker))
    try:
        loaded = tl.load(art)
    except TorchLensError as exc:  # a cell whose type the loader checks: refused, typed
        assert not marker.exists() and exc.code.startswith(("record_", "manifest_")), repr(exc)
        return
    found = [ph for c in _all_cells(loaded) for ph in _placeholders(c) if ph.qualname == HOSTILE]
    assert found, "the hostile name must load as an inert placeholder, never as a callable"
    outcomes = []
    for action in (lambda: loaded.validate_forward_pass(), lambda: loaded.fork().do("input_1", tl.scale(0.5)),
                   lambda: loaded.fork().do("linear_1_1", tl.scale(2.0))):
        try:
            outcomes.append((action(), None))
        except TorchLensError as exc:
            outcomes.append((None, exc))
    assert not marker.exists(), "a loaded artifact ran code"
    if (kind, col) in _REPLAYED:
        assert outcomes[0][1] is not None and outcomes[0][1].code == OPAQUE, outcomes[0]
        assert outcomes[0][1].fields["label"] in ("relu_1_2", "linear_1_1", "linear_2_3")
    else:
        assert outcomes[0] == (True, None), outcomes[0]
    for _, exc in outcomes[1:]:
        assert exc is None or exc.code == OPAQUE, repr(exc)
    for ph in found:
        with pytest.raises(ArtifactError) as info:
            ph(f"touch {marker}")
        assert info.value.code == "callable_not_persisted"
    assert not marker.exists()


@pytest.mark.parametrize("name", ["builtins.exec", "os.system", "torchlens_reference.ops.__class__",
                                  "torchlens_reference.ops.np.save", "torchlens_reference.ops", "numpy.save",
                                  "torchlens_reference.backend.ReferenceBackend.capture"])
def test_reference_backend_table_refuses_foreign_names(art, tmp_path, name):
    marker = tmp_path / MARKER_NAME

    def edit(t):
        row, i = cell(t, "ops", "relu_1_2", "func")
        row[i] = {"$callable": name}
        row[t["ops"]["columns"].index("args_template")] = tup(str(marker), {"$argref": [0, None]})

    rewrite_records(art, edit)
    loaded = tl.load(art)
    assert isinstance(loaded.ops["relu_1_2"].func, CallablePlaceholder)
    for action in (loaded.validate_forward_pass, lambda: loaded.fork().do("linear_1_1", tl.scale(2.0))):
        with pytest.raises(ArtifactError) as info:
            action()
        assert info.value.code == OPAQUE
    assert not marker.exists()


def test_trace_without_opaque_ops_is_unaffected(saved):
    loaded = tl.load(saved)
    assert loaded.validate_forward_pass()
    a = loaded.fork().do("linear_1_1", tl.scale(2.0))
    assert not np.array_equal(a["linear_2_3"].out, loaded["linear_2_3"].out)


# recipes and intervention specs ----------------------------------------------------------------
def _rewrite_spec(path: Path, edit) -> None:
    doc = json.loads((path / "intervention.json").read_bytes())
    edit(doc)
    body = json.dumps(doc).encode()
    (path / "intervention.json").write_bytes(body)
    m = json.loads((path / "manifest.json").read_bytes())
    m["files"]["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.fixture
def ref_model():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)


@pytest.mark.parametrize("qualname", ["builtins.exec", "os.system", "torch.fx.graph_module._exec_with_source"])
def test_spec_placeholder_with_hostile_name_refuses(tmp_path, ref_model, qualname):
    model, x = ref_model
    marker = tmp_path / MARKER_NAME
    t = tl.trace(model, x).fork().do("relu_1_2", lambda v, *, ctx: v * 2)
    path = tl.io.save_intervention(t, tmp_path / "audit.tlspec", level="audit")

    def edit(doc):
        doc["rules"][0]["edit"].update(name=qualname.rpartition(".")[2], qualname=qualname)

    _rewrite_spec(path, edit)
    spec = tl.io.load_intervention_spec(path)
    helper = spec.hook_specs[0].helper
    assert helper.portability == "placeholder" and helper.qualname == qualname
    with pytest.raises(TorchLensError) as info:
        tl.trace(model, x).fork().do(spec)
    assert info.value.code == "run_intervention_spec_not_persisted"
    assert not marker.exists()


@pytest.mark.parametrize("where", ["name", "kwargs_callable", "kind_recipe"])
def test_spec_builtin_slots_never_rebuild_code(tmp_path, ref_model, where):
    model, x = ref_model
    marker = tmp_path / MARKER_NAME
    path = tl.io.save_intervention(tl.when("relu_1_2", tl.scale(2.0)), tmp_path / "r.tlspec")

    def edit(doc):
        e = doc["rules"][0]["edit"]
        if where == "name":
            e["name"] = "exec"
            e["kwargs"] = [["source", exec_source(marker)]]
        elif where == "kwargs_callable":
            e["kwargs"] = [["factor", {"$callable": "builtins.exec"}]]
        else:  # a recipe holding a placeholder is audit-only
            doc["rules"][0]["edit"] = {"name": "system", "portability": "placeholder", "qualname": HOSTILE}

    _rewrite_spec(path, edit)
    with pytest.raises(ArtifactError) as info:
        tl.load(path)
    assert info.value.code == ("recipe_audit_only" if where == "kind_recipe" else "recipe_record_malformed")
    assert not marker.exists()
