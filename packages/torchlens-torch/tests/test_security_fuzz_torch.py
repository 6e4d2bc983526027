"""Hostile files with torch payloads: typed refusals for bogus torch literals and payload
metadata (validate_tlspec refusing exactly what tl.load refuses), and the seeded fuzz suite
over torch traces, torch intervention specs and torch safetensors exports
(TORCHLENS_FUZZ_BIG=1 runs ten times more cases)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchlens_torch")

import torchlens as tl  # noqa: E402
from torchlens.errors import TorchLensError  # noqa: E402
from torchlens_conformance.hostile import Template, fuzz  # noqa: E402

BIG = os.environ.get("TORCHLENS_FUZZ_BIG") == "1"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x).t()  # a transposed payload: saved with a "perm" in its metadata
        z = torch.zeros(2, dtype=torch.float64, device="cpu")  # dtype and device literals in the template
        return y.to(torch.float64).sum() + z.sum() + (x > 0).to(torch.int32).sum()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("torch_hostile")
    t = tl.trace(Net(), torch.randn(2, 4))
    return t, t.save(root / "t.tlspec"), root


def _reseal(root):
    m = json.loads((root / "manifest.json").read_text())
    for name in m["files"]:
        data = (root / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / "manifest.json").write_text(json.dumps(m))


def _codes(path):
    """The codes of tl.load and validate_tlspec (both must refuse, typed)."""
    out = []
    for fn in (tl.load, tl.validation.validate_tlspec):
        with pytest.raises(TorchLensError) as info:
            fn(path)
        out.append(info.value.code)
    return out


def _edit_records(src, dst, kind, edit):
    shutil.copytree(src, dst)
    p = dst / "records" / f"{kind}.json"
    table = json.loads(p.read_text())
    edit(table)
    p.write_text(json.dumps(table, separators=(",", ":")))
    _reseal(dst)
    return dst


def _literal_cells(x):
    if isinstance(x, dict):
        if set(x) == {"$literal"}:
            yield x
        for v in x.values():
            yield from _literal_cells(v)
    elif isinstance(x, list):
        for v in x:
            yield from _literal_cells(v)


@pytest.mark.parametrize("kind,plain", [("torch.device", "bogus"), ("torch.device", "cpu:-5"),
                                        ("torch.device", "cuda:99999999999999999999"), ("torch.dtype", "__class__"),
                                        ("torch.dtype", "Tensor"), ("torch.Size", {"$tuple": [10**30]}),
                                        ("torch.Size", {"$tuple": [2**64]})])
def test_bogus_torch_literals_refuse_typed_in_load_and_validate(saved, tmp_path, kind, plain):
    _, path, _ = saved

    def edit(table):
        cell = next(c for c in _literal_cells(table["rows"]) if c["$literal"][0] == "torch.dtype")
        cell["$literal"] = [kind, plain]

    bad = _edit_records(path, tmp_path / "b.tlspec", "ops", edit)
    # was: RuntimeError (device), or validate_tlspec accepting what tl.load refused (dtype '__class__')
    assert _codes(bad) == ["record_schema_invalid", "record_schema_invalid"]


@pytest.mark.parametrize("meta", [{"perm": "x"}, {"perm": "1,1"}, {"perm": "0,1,2"}, {"perm": "\u00b2,0"},
                                  {"requires_grad": "yes"}, {"parameter": "0"}, {"device": "bogus"},
                                  {"pickle": "1"}])
def test_payload_metadata_is_checked_in_load_and_validate(saved, tmp_path, meta):
    _, path, _ = saved

    def edit(table):
        cols = table["columns"]
        row = next(r for r in table["rows"] if "perm" in r[cols.index("meta")]) if "perm" in meta else table["rows"][0]
        row[cols.index("meta")].update(meta)

    bad = _edit_records(path, tmp_path / "m.tlspec", "payloads", edit)
    assert _codes(bad) == ["payload_meta_invalid", "payload_meta_invalid"]  # was: load blob_malformed, validate ok


def test_requires_grad_on_an_integer_payload_is_typed(saved, tmp_path):
    _, path, _ = saved

    def edit(table):
        cols = table["columns"]
        row = next(r for r in table["rows"] if r[cols.index("dtype")] in ("int32", "int64", "bool"))
        row[cols.index("meta")].update({"requires_grad": "1", "parameter": "1"})

    bad = _edit_records(path, tmp_path / "g.tlspec", "payloads", edit)
    assert _codes(bad) == ["payload_meta_invalid", "payload_meta_invalid"]


def test_saved_false_with_payloads_refuses_in_validate_too(saved, tmp_path):
    _, path, _ = saved

    def edit(table):
        cols = table["columns"]
        row = next(r for r in table["rows"] if r[cols.index("saved")] and any(r[cols.index("outputs")]))
        row[cols.index("saved")] = False

    assert _codes(_edit_records(path, tmp_path / "s.tlspec", "ops", edit)) == ["record_schema_invalid"] * 2


def _templates(tmp_path, trace, path):
    out = [Template("trace:torch", path, "tlspec"),
           Template("export:torch", tl.export.safetensors(trace, tmp_path / "e.safetensors"), "safetensors")]
    fork = trace.fork().do("linear_1_1", tl.steer(torch.ones(3), 2.0))
    out.append(Template("spec:torch", tl.io.save_intervention(fork, tmp_path / "s.tlspec"), "spec"))
    fork2 = trace.fork().do("linear_1_1", tl.replace_with(torch.arange(6.0).reshape(2, 3))).do(tl.func("sum"), tl.scale(0.5))
    out.append(Template("spec2:torch", tl.io.save_intervention(fork2, tmp_path / "s2.tlspec"), "spec"))
    return out


def test_hostile_files_fuzz_torch(saved, tmp_path):
    trace, path, _ = saved
    report = fuzz(_templates(tmp_path, trace, path), cases=3000 if BIG else 300, seed=77, workdir=tmp_path / "cases",
                  alloc_a=64.0, alloc_b=8 * 2**20)
    print("\nhostile files (torch):", report.summary())
    assert report.failures == [], "\n".join(report.failures[:20])
    assert report.outcomes["raw"] == 0 and report.outcomes["refused"] > report.cases // 2
