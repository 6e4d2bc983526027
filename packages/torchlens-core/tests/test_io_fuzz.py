"""Mutation fuzzing of saved artifacts: every damaged artifact either refuses with a
registered TorchLensError code or, when the damage leaves it loadable (whitespace in the
manifest), loads a trace equal to the original. Never an untyped exception or a wrong trace."""

from __future__ import annotations

import collections
import json
import random
import shutil

import pytest

import torchlens as tl
from torchlens.errors import ERROR_CODES, TorchLensError
from torchlens_reference.zoo import zoo

CASES = 600


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _mutate(rng: random.Random, root, tmp):
    files = _files(root)
    f = rng.choice(files)
    kind = rng.choice(["flip", "byte", "truncate", "delete", "symlink", "version", "manifest_value", "whitespace",
                       "append", "rmdir", "flip_manifest", "flip_manifest"])
    if kind in ("flip", "flip_manifest", "byte"):
        f = root / "manifest.json" if kind == "flip_manifest" else f
        raw = bytearray(f.read_bytes())
        if raw:
            i = rng.randrange(len(raw))
            raw[i] = raw[i] ^ (1 << rng.randrange(8)) if kind != "byte" else rng.randrange(256)
        f.write_bytes(bytes(raw))
    elif kind == "truncate":
        raw = f.read_bytes()
        f.write_bytes(raw[:rng.randrange(len(raw) + 1)])
    elif kind == "append":
        with open(f, "ab") as h:
            h.write(rng.choice([b" ", b"\n", b"x", b"\x00" * 9]))
    elif kind == "delete":
        f.unlink()
    elif kind == "rmdir":
        shutil.rmtree(root / rng.choice(["records", "blobs"]))
    elif kind == "symlink":
        target = tmp / f"outside-{rng.randrange(10**9)}"
        where = rng.choice(["file", "dir", "extra"])
        if where == "file":
            shutil.copy(f, target)
            f.unlink()
            f.symlink_to(target)
        elif where == "dir":
            d = root / rng.choice(["records", "blobs"])
            shutil.copytree(d, target)
            shutil.rmtree(d)
            d.symlink_to(target)
        else:
            target.write_bytes(b"{}")
            (root / rng.choice(["records", "blobs", "."]) / f"evil{rng.randrange(9)}.json").symlink_to(target)
    elif kind in ("version", "manifest_value"):
        m = json.loads((root / "manifest.json").read_text())
        if kind == "version":
            key = rng.choice(["format_version", "format", "torchlens_version", "schema_digest", "kind", "level"])
            m[key] = rng.choice([2, 4, "3", None, 3.0, True, "v3", "", 0, -1, 3])
        else:
            section = rng.choice(["counts", "disclosures", "backend", "files"])
            key = rng.choice(sorted(m[section]))
            m[section][key] = rng.choice([0, 1, 99, None, "x", {}, [], {"sha256": "0" * 64, "size": 1}])
        (root / "manifest.json").write_text(json.dumps(m))
    elif kind == "whitespace":
        text = (root / "manifest.json").read_text()
        positions = [i for i, c in enumerate(text) if c in " \n"]
        i = rng.choice(positions)
        (root / "manifest.json").write_text(text[:i] + rng.choice([" ", "\n", "\t", "\r\n", "  "]) + text[i:])
    return kind


def test_mutated_artifacts_refuse_with_a_code_or_load_equal(tmp_path):
    rng = random.Random(20240607)
    originals = {}
    for name, entry in zoo().items():
        if "reseed" in entry:
            entry["reseed"]()
        t = tl.trace(entry["model"], *entry["args"], input_kwargs=entry["kwargs"])
        t.annotations = {"opaque": object(), "shared": t.ops[1].out}
        originals[name] = (t, t.save(tmp_path / "templates" / f"{name}.tlspec"))
    outcomes: collections.Counter = collections.Counter()
    loaded_equal = 0
    for case in range(CASES):
        name = rng.choice(sorted(originals))
        t, template = originals[name]
        work = tmp_path / "cases" / f"c{case}"
        root = work / "t.tlspec"
        shutil.copytree(template, root)
        kind = _mutate(rng, root, work)
        lazy = rng.random() < 0.3
        try:
            loaded = tl.load(root, lazy=lazy)
        except TorchLensError as exc:
            assert exc.code in ERROR_CODES, (case, kind, exc)
            outcomes[exc.code] += 1
        except Exception as exc:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"case {case} ({kind} on {name}): untyped {type(exc).__name__}: {exc}")
        else:
            diffs = tl.io.trace_differences(t, loaded)
            assert diffs == [], (case, kind, diffs)
            loaded_equal += 1
            outcomes["loaded_equal"] += 1
        if case % 50 == 0:
            shutil.rmtree(tmp_path / "cases", ignore_errors=True)
    assert sum(outcomes.values()) == CASES
    assert len(outcomes) >= 10, outcomes  # the mutations reach many distinct checks
    print(f"\n{CASES} mutated artifacts: {dict(outcomes.most_common())}")
