"""Extraction helpers and dataset-scale runs on torch (issue 23), checked against forward
hooks and NumPy: pluck/extract, extract_dataset in memory and on disk, tl.load, resume after
SIGKILL, refusals of changed runs and corrupt/foreign shards, token rows, aggregate
(activations and gradients), and a two-process gloo run equal to the one-process run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torchlens as tl
from torchlens.errors import ArtifactError, InvalidArgumentError

sys.path.insert(0, os.path.dirname(__file__))
from extract_models import hooked, token_data, token_model  # noqa: E402

HERE = Path(__file__).parent
LAYERS = ["fc1", "act"]


def test_pluck_and_extract_equal_forward_hooks():
    model, x = token_model(), token_data(n=5)
    want = hooked(model, x, ["fc1", "act", "fc2"])
    got = tl.extract(model, x, ["fc1", "act"])
    assert set(got) == {"fc1", "act"}
    for k in got:
        assert torch.equal(got[k], want[k]) and not got[k].requires_grad
    assert torch.equal(tl.pluck(model, x, "fc2"), want["fc2"])
    live = tl.extract(model, x, "fc1", detach_saved_activations=False)["fc1"]
    assert live.requires_grad and live.grad_fn is not None
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract(model, x, [])
    assert e.value.code == "extraction_layers_invalid"


def test_extract_dataset_memory_mode_equals_hooks():
    model, x = token_model(), token_data()
    r = tl.extract_dataset(model, x, LAYERS, batch_size=16, progress=False)
    want = hooked(model, x, LAYERS)
    assert r.num_shards == 5 and r.num_rows == 70
    for k in LAYERS:
        assert np.array_equal(r[k], want[k].numpy())


def test_disk_mode_manifest_and_load(tmp_path):
    model, x = token_model(), token_data()
    out = tmp_path / "run"
    ids = [f"s{i}" for i in range(70)]
    r = tl.extract_dataset(model, x, LAYERS, batch_size=16, path=out, stimulus_ids=ids, store_input_ids=True, progress=False)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["batch_00000.safetensors", "batch_00001.safetensors", "batch_00002.safetensors",
                     "batch_00003.safetensors", "batch_00004.safetensors", "manifest.json"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and m["num_rows"] == 70 and m["stimulus_ids"] == ids
    assert [s["key"] for s in m["sites"]] == LAYERS + ["input_ids"]
    assert m["sites"][0]["axes"][:2] == ["stimulus", "position"] and m["sites"][0]["stored_dtype"] == "float32"
    assert m["signature"]["layers"] == LAYERS and len(m["signature"]["param_digest"]) == 64
    loaded = tl.load(out)
    assert isinstance(loaded, tl.LoadedExtraction) and loaded.signature == m["signature"]
    want = hooked(model, x, LAYERS)
    for k in LAYERS:
        assert np.array_equal(loaded[k], want[k].numpy()) and np.array_equal(r[k], loaded[k])
    assert np.array_equal(loaded["input_ids"], x.numpy())
    # token rows: one row per token, with where it came from
    tr = loaded.token_batch(1, keys=["fc1", "input_ids"])
    assert tr.num_tokens == 16 * 6
    assert np.array_equal(tr.values["input_ids"], x[tr.stimulus_row, tr.position].numpy())
    assert np.array_equal(tr.values["fc1"], want["fc1"][tr.stimulus_row, tr.position].numpy())
    allrows = loaded.token_rows(["act"])
    assert allrows.num_tokens == 70 * 6
    with pytest.raises(InvalidArgumentError):
        loaded.token_rows(["act"], max_bytes=100)
    seen = []
    for batch in loaded.shuffled_batches(32, seed=3, keys=["act"], buffer_shards=2, tokens=True):
        assert np.array_equal(batch.values["act"], want["act"][batch.stimulus_row, batch.position].numpy())
        seen += list(zip(batch.stimulus_row.tolist(), batch.position.tolist()))
    assert sorted(seen) == [(s, p) for s in range(70) for p in range(6)]
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract_dataset(model, x, LAYERS, batch_size=16, path=out)
    assert e.value.code == "extraction_path_exists"


def _kill_after_shards(out: Path, shards: int) -> None:
    proc = subprocess.Popen([sys.executable, str(HERE / "extract_worker.py"), "disk", str(out), "0.4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while len(list(out.glob("batch_*.safetensors"))) < shards:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run wrote no shards in time"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_then_resume_gives_identical_shards(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    _kill_after_shards(killed, 3)
    written = len(list(killed.glob("batch_*.safetensors")))
    assert 3 <= written < 9, written
    m = json.loads((killed / "manifest.json").read_text())
    assert m["status"] == "running"
    with pytest.raises(ArtifactError) as e:
        tl.load(killed)
    assert e.value.code == "extraction_manifest_invalid"
    tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8, path=killed, resume=True, progress=False)
    tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8, path=clean, progress=False)
    names = sorted(p.name for p in clean.glob("batch_*.safetensors"))
    assert len(names) == 9 and names == sorted(p.name for p in killed.glob("batch_*.safetensors"))
    for n in names:
        assert (killed / n).read_bytes() == (clean / n).read_bytes(), n
    assert not list(killed.glob(".*.tmp"))
    a, b = json.loads((killed / "manifest.json").read_text()), json.loads((clean / "manifest.json").read_text())
    assert a["shards"] == b["shards"] and a["run"] == b["run"]


def _partial_run(tmp_path: Path) -> Path:
    """A run with shards 0..3 of 9 on disk and the manifest still 'running' (as if killed)."""
    full = tmp_path / "full"
    tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8, path=full, progress=False)
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for i in range(4, 9):
        (part / f"batch_{i:05d}.safetensors").unlink()
    m = json.loads((part / "manifest.json").read_text())
    m.update(status="running", shards=[], sites=[])
    (part / "manifest.json").write_text(json.dumps(m))
    return part


def test_resume_refuses_changed_model_or_dataset(tmp_path):
    part = _partial_run(tmp_path)
    before = sorted((p.name, p.read_bytes()) for p in part.iterdir())
    changed = token_model()
    with torch.no_grad():
        changed.fc2.bias[0] += 1e-3
    with pytest.raises(ArtifactError) as e:
        tl.extract_dataset(changed, token_data(), LAYERS, batch_size=8, path=part, resume=True)
    assert e.value.code == "extraction_resume_signature_mismatch" and "param_digest" in e.value.fields["differs"]
    data = token_data()
    data[10, 2] = (data[10, 2] + 1) % 40  # a row inside finished shard 1
    with pytest.raises(ArtifactError) as e:
        tl.extract_dataset(token_model(), data, LAYERS, batch_size=8, path=part, resume=True)
    assert e.value.code == "extraction_resume_signature_mismatch" and e.value.fields["differs"] == ["dataset"]
    with pytest.raises(ArtifactError) as e:
        tl.extract_dataset(token_model(), token_data(n=71), LAYERS, batch_size=8, path=part, resume=True)
    assert e.value.code == "extraction_resume_signature_mismatch"
    assert sorted((p.name, p.read_bytes()) for p in part.iterdir()) == before  # nothing was written


def test_corrupt_and_foreign_shards_refuse_typed(tmp_path):
    part = _partial_run(tmp_path)
    other = tmp_path / "other"
    tl.extract_dataset(token_model(seed=5), token_data(), LAYERS, batch_size=8, path=other, progress=False)
    shutil.copy(other / "batch_00002.safetensors", part / "batch_00002.safetensors")
    with pytest.raises(ArtifactError) as e:
        tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8, path=part, resume=True)
    assert e.value.code == "extraction_shard_foreign"
    loaded = tl.load(other)
    shard = other / "batch_00003.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    loaded.shard(2)
    with pytest.raises(ArtifactError) as e:
        loaded.shard(3)
    assert e.value.code == "extraction_shard_invalid"
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(ArtifactError) as e:
        tl.load(other).shard(3)
    assert e.value.code == "extraction_shard_invalid"
    m = json.loads((other / "manifest.json").read_text())
    m["shards"][0]["file"] = "../../etc/passwd"
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError) as e:
        tl.load(other)
    assert e.value.code == "extraction_manifest_invalid"


def test_aggregate_activations_and_gradients_equal_hooks_and_autograd():
    from extract_worker import loader, loss_fn, metrics

    model = token_model()
    res = tl.stats.aggregate(model, loader(), metrics(), loss_fn=loss_fn)
    assert set(res) == {"fc1", "act", "(fc1, act)", "fc2", "tl.grad('fc1')"}
    x = torch.cat(loader())
    acts = hooked(model, x, ["fc1", "act", "fc2"])
    fc1 = acts["fc1"].numpy().astype(np.float64).reshape(-1, 12)
    act = acts["act"].numpy().astype(np.float64).reshape(-1, 12)
    assert np.allclose(res["fc1"].covariance(), np.cov(fc1, rowvar=False), rtol=1e-10, atol=1e-12)
    assert np.allclose(res["act"].mean, act.mean(0), rtol=1e-10, atol=1e-13)
    xc, yc = fc1 - fc1.mean(0), act - act.mean(0)
    cka = np.linalg.norm(yc.T @ xc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))
    assert abs(res["(fc1, act)"].result() - cka) < 1e-10
    top = res["fc2"].result()
    fc2 = acts["fc2"].numpy().astype(np.float64)  # [examples, tokens, units]
    for u in range(5):
        cells = sorted((-fc2[e, p, u], e, p) for e in range(len(x)) for p in range(6))[:3]
        assert top.values[u].tolist() == [-c[0] for c in cells] and top.example_ids[u].tolist() == [c[1] for c in cells]
    # gradients: the same loss through plain autograd, per batch
    grads = []
    for b in loader():
        h = {}

        def keep(m, i, o):
            o.retain_grad()
            h["o"] = o

        handle = model.fc1.register_forward_hook(keep)
        loss_fn(model(b)).backward()
        handle.remove()
        grads.append(h["o"].grad.numpy().astype(np.float64).reshape(-1, 12))
    model.zero_grad()
    assert np.allclose(res["tl.grad('fc1')"].mean, np.concatenate(grads).mean(0), rtol=1e-10, atol=1e-13)


def test_aggregate_refusals_before_running():
    with pytest.raises(InvalidArgumentError) as e:
        tl.stats.aggregate(token_model(), [token_data(n=4)], {tl.grad("fc1"): tl.stats.Mean()})
    assert e.value.code == "aggregate_loss_fn_required"
    with pytest.raises(InvalidArgumentError) as e:
        tl.stats.aggregate(token_model(), [token_data(n=4)], {"fc1": object()})
    assert e.value.code == "aggregate_metric_invalid"
    with pytest.raises(InvalidArgumentError) as e:
        tl.stats.aggregate(token_model(), [token_data(n=4)], {"fc1": tl.stats.CKA()})
    assert e.value.code == "aggregate_metric_invalid"


def test_two_process_gloo_run_equals_one_process(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    proc = subprocess.run([sys.executable, str(HERE / "extract_worker.py"), "ranks", str(tmp_path), init],
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    _check_two_ranks(tmp_path)


def test_torchrun_two_processes_equal_one_process(tmp_path):
    """The command docs/guides/datasets.md gives, on loopback, with no manual provider import."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(torchrun + [str(HERE / "extract_worker.py"), "torchrun", str(tmp_path)],
                          capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    _check_two_ranks(tmp_path)


def _check_two_ranks(tmp_path):
    from extract_worker import loader, loss_fn, metrics

    single = tl.stats.aggregate(token_model(), loader(), metrics(), loss_fn=loss_fn)
    for key, acc in single.items():
        safe = "".join(c if c.isalnum() else "_" for c in key)
        for rank in (0, 1):
            got = tl.stats.load_fitted(tmp_path / f"r{rank}_{safe}.safetensors")
            want = acc.state_dict()
            assert got.state_dict().keys() == want.keys()
            for k in want:  # the same float64 state, bit for bit
                assert np.array_equal(got.state_dict()[k], want[k]), (key, k)
    m = json.loads((tmp_path / "ext" / "manifest.json").read_text())
    assert m["world_size"] == 2 and m["status"] == "complete"
    assert [e["index"] for e in m["shards"]] == list(range(9))
    assert {e["rank"] for e in m["shards"]} == {0, 1}
    assert all(e["rank"] == e["index"] % 2 for e in m["shards"])
    loaded = tl.load(tmp_path / "ext")
    assert np.array_equal(loaded["input_ids"], token_data().numpy())  # every row once, in order
    want = hooked(token_model(), token_data(), LAYERS)
    assert np.array_equal(loaded["fc1"], want["fc1"].numpy())
    for rank in (0, 1):
        assert np.array_equal(np.load(tmp_path / f"r{rank}_mem_fc1.npy"), want["fc1"].numpy())


def test_loading_never_unpickles(tmp_path, monkeypatch):
    import pickle

    tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=16, path=tmp_path / "run", progress=False)
    tl.stats.save_fitted(tl.stats.Covariance().update(np.ones((3, 2))), tmp_path / "c.safetensors")

    def refuse(*a, **k):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    loaded = tl.load(tmp_path / "run")
    assert all(len(s["fc1"]) for s in loaded.batches())
    assert tl.stats.load_fitted(tmp_path / "c.safetensors").count == 3


def test_option_and_group_refusals():
    import torchlens_torch.distributed_data  # noqa: F401  (registers the provider; no group is initialised here)

    x = token_data(n=8)
    for kwargs, code in (({"intervene": "zero fc1"}, "invalid_argument"),
                         ({"ragged": "pad"}, "extraction_option_unsupported"),
                         ({"distributed": "yes"}, "distributed_group_invalid"),
                         ({"distributed": True}, "distributed_unavailable"),
                         ({"batch_size": 0}, "extraction_dataset_invalid")):
        with pytest.raises(InvalidArgumentError) as e:
            tl.extract_dataset(token_model(), x, LAYERS, **{"batch_size": 4, **kwargs})
        assert e.value.code == code, kwargs


def test_ready_batches_and_one_shot_iterators(tmp_path):
    model, x = token_model(), token_data(n=20)
    batches = [x[:7], x[7:15], x[15:]]
    r = tl.extract_dataset(model, batches, ["fc2"], batch_size=None, progress=False)
    assert [r.shard(i)["fc2"].shape[0] for i in range(3)] == [7, 8, 5]
    assert np.array_equal(r["fc2"], hooked(model, x, ["fc2"])["fc2"].numpy())
    ragged = [x[:4], x[4:9, :3], x[9:, :5]]  # ready batches of different token lengths
    loaded = tl.load(tl.extract_dataset(model, ragged, ["fc2"], batch_size=None, path=tmp_path / "v", progress=False).root)
    assert loaded.sites[0]["varying_shape"] is True
    for i, b in enumerate(ragged):
        assert np.array_equal(loaded.shard(i)["fc2"], hooked(model, b, ["fc2"])["fc2"].numpy())
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract_dataset(model, iter(batches), ["fc2"], batch_size=None)
    assert e.value.code == "extraction_dataset_invalid"


def test_manifest_signature_records_the_lens_model_identity(tmp_path):
    from torchlens.lens import model_identity

    model, x = token_model(), token_data(n=8)
    tl.extract_dataset(model, x, LAYERS, batch_size=4, path=tmp_path / "a")
    ident = json.loads((tmp_path / "a" / "manifest.json").read_text())["signature"]["model_identity"]
    assert ident == model_identity(tl.trace(model, x[:2]))  # the record a user lens compares against
    with torch.no_grad():
        model.fc2.bias.add_(1.0)
    tl.extract_dataset(model, x, LAYERS, batch_size=4, path=tmp_path / "b")
    changed = json.loads((tmp_path / "b" / "manifest.json").read_text())["signature"]["model_identity"]
    assert changed["param_hash_full"] != ident["param_hash_full"]
    assert changed["param_hash_full"] == model_identity(tl.trace(model, x[:2]))["param_hash_full"]


@pytest.mark.parametrize("disk", [False, True])
def test_ragged_trim_stores_no_padding_token_rows(tmp_path, disk):
    from extract_models import MaskedTokenNet, ragged_data

    torch.manual_seed(0)
    model, data = MaskedTokenNet().eval(), ragged_data()
    mask = data["attention_mask"].numpy()
    # the oracle: forward hooks on one plain forward over every row, then the real tokens picked by the mask
    got_hook = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: got_hook.__setitem__(n, o.detach()))
               for n in ("fc1", "act")]
    with torch.no_grad():
        model(**data)
    for h in handles:
        h.remove()
    r = tl.extract_dataset(model, data, ["fc1", "act"], batch_size=4, ragged="trim", store_input_ids=True,
                           path=tmp_path / "run" if disk else None)
    rows = r.token_rows()
    real = mask.astype(bool)
    assert rows.num_tokens == int(mask.sum())  # padding is never a token row
    assert np.array_equal(rows.stimulus_row, np.nonzero(real)[0]) and np.array_equal(rows.position, np.nonzero(real)[1])
    assert np.array_equal(rows.values["input_ids"], data["input_ids"].numpy()[real])
    for n in ("fc1", "act"):
        assert np.array_equal(rows.values[n], got_hook[n].numpy()[real]), n
    for i in range(r.num_shards):  # each shard is trimmed to its batch's longest real row
        sl = slice(4 * i, 4 * i + 4)
        assert r.shard(i, ["fc1"])["fc1"].shape[1] == int(mask[sl].sum(1).max())
    with pytest.raises(InvalidArgumentError) as e:
        r["fc1"]  # widths differ between shards: no silent padding or concatenation error
    assert e.value.code == "invalid_argument"


def test_ragged_trim_refusals():
    from extract_models import MaskedTokenNet, ragged_data

    data = ragged_data(n=4)
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract_dataset(token_model(), data["input_ids"], LAYERS, batch_size=2, ragged="trim")
    assert e.value.code == "extraction_dataset_invalid"  # no attention_mask to trim by
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract_dataset(MaskedTokenNet(), data, LAYERS, batch_size=2, ragged="pad")
    assert e.value.code == "extraction_option_unsupported"
    bad = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"] * 2}
    with pytest.raises(InvalidArgumentError) as e:
        tl.extract_dataset(MaskedTokenNet(), bad, LAYERS, batch_size=2, ragged="trim")
    assert e.value.code == "extraction_dataset_invalid"


def _zeroed_hooks(model, x, names):
    """The oracle of an intervened extraction: fc1's output zeroed by a forward hook."""
    zero = model.fc1.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        return hooked(model, x, names)
    finally:
        zero.remove()


@pytest.mark.parametrize("disk", [False, True])
def test_intervened_extraction_stores_the_intervened_rows(tmp_path, disk):
    model, x = token_model(), token_data(n=10)
    spec = tl.when(tl.module("fc1"), tl.zero_ablate())
    r = tl.extract_dataset(model, x, ["act", "fc2"], batch_size=4, intervene=spec, path=tmp_path / "run" if disk else None)
    want = _zeroed_hooks(model, x, ["act", "fc2"])
    for n in ("act", "fc2"):
        assert np.array_equal(r[n], want[n].numpy()), n
    assert not np.array_equal(r["fc2"], hooked(model, x, ["fc2"])["fc2"].numpy())  # it did change the rows
    block = r.manifest["tl_counterfactual_harvest_v1"]
    assert block["policy"] == "intervene" and block["engine"] == "live_hook" and block["address_class"] == ["module"]
    fc1_label = [o.label for o in tl.trace(model, x[:4]).ops if o.module == "fc1"]
    assert block["site_keys"] == fc1_label
    assert [e["fire_receipt"] for e in r.manifest["shards"]] == [{"index": i, "fired": {fc1_label[0]: 1}} for i in range(3)]
    assert r.manifest["signature"]["intervention"]["recipe_digest"] == spec.digest
    if disk:  # the intervention identity is in the resume signature: a clean resume of this run refuses
        with pytest.raises(ArtifactError) as e:
            tl.extract_dataset(model, x, ["act", "fc2"], batch_size=4, path=tmp_path / "run", resume=True)
        assert e.value.code == "extraction_resume_signature_mismatch" and "intervention" in e.value.fields["differs"]
        again = tl.extract_dataset(model, x, ["act", "fc2"], batch_size=4, intervene=spec, path=tmp_path / "run",
                                   resume=True)
        assert np.array_equal(again["fc2"], want["fc2"].numpy())


def test_intervened_extraction_site_freeze_and_refusals():
    from extract_models import LoopNet

    x = token_data(n=10)
    spec = tl.when(tl.module("fc1"), tl.zero_ablate())
    cases = [(LoopNet(per_row=True), spec, "extraction_intervention_site_drift"),  # last batch: 2 passes, not 4
             (LoopNet(skip_below=3), spec, "extraction_intervention_no_fire"),  # last batch skips fc1
             (token_model(), tl.when(tl.label("relu_1_3"), tl.zero_ablate()), "harvest_address_class_ungated"),
             (token_model(), tl.when(tl.module("fc1"), tl.mean_ablate(dim=0)), "extraction_intervention_batch_coupled")]
    for model, s, code in cases:
        torch.manual_seed(0)
        with pytest.raises(InvalidArgumentError) as e:
            tl.extract_dataset(model, x, ["emb"], batch_size=4, intervene=s)
        assert e.value.code == code, code
    clean = tl.extract_dataset(token_model(), x, ["fc2"], batch_size=4)
    assert clean.manifest["tl_counterfactual_harvest_v1"] == {"policy": "none"}
