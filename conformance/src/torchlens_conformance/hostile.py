"""Hostile-file fuzzing of every saved artifact kind (seeded, bounded, framework-neutral).

A backend's test suite saves a few templates (a trace `.tlspec`, an intervention spec, a
recipe, a safetensors export) and calls `fuzz(templates, cases=..., seed=...)`. Each case
copies one template, applies one mutation an attacker could make (byte flips, truncation,
extension, JSON structure edits: deep nesting, huge numbers, wrong types, duplicate and
unknown keys, huge declared sizes, shapes and counts, hostile path names; with the digests
recomputed, as an attacker can, or left stale) and then runs every reader on it:
`tl.load` (or `tl.io.read_safetensors`), `tl.validation.validate_tlspec` and
`tl.io.detect_tlspec_format`.

What a case must show (else `HostileReport.failures` names it):
  * every reader ends in a `TorchLensError` whose code is registered, or returns;
  * a loaded object equals the template's, unless the mutation recomputed digests (then
    the file is an attacker-authored artifact, and loading it is allowed: "valid_other");
  * `validate_tlspec` refuses exactly when `tl.load` refuses, with the same code;
  * the load's peak traced allocation (tracemalloc: Python objects and numpy buffers) is
    at most `alloc_a * artifact_bytes + alloc_b`.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------
# JSON with the shapes an attacker can write (duplicate keys, raw text) -----------------------


class Raw(str):
    """Text written verbatim (deep nesting, numbers beyond float range, digits beyond int limits)."""


class Pairs(list):
    """An object written from (key, value) pairs, so keys may repeat."""


def render(x: Any) -> str:
    if isinstance(x, Raw):
        return str(x)
    if isinstance(x, Pairs):
        return "{" + ",".join(json.dumps(k) + ":" + render(v) for k, v in x) + "}"
    if isinstance(x, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + render(v) for k, v in x.items()) + "}"
    if isinstance(x, list):
        return "[" + ",".join(render(v) for v in x) + "]"
    return json.dumps(x)


_HUGE = ["-1", "3221225472", "1000000000000000", "9223372036854775808", "18446744073709551616", "1e308", "1e999",
         "-0", "4294967296", "1" + "0" * 5000]
_WRONG = [None, True, False, 0, 1.5, "x", "", [], {}, [1], {"a": 1}, [[]]]
_PATHS = ["/etc/passwd", "../../x", "/abs/file.json", "a\x00b", "x" * 5000, "blobs/../../etc/passwd",
          "records/../manifest.json", "blobs/recipe-0000.safetensors/../../../x", "C:\\windows\\x", "\u202eevil",
          "records/ops.json\x00.png", "blobs/payloads-9999.safetensors", "records/x.json"]
_SIZE_KEYS = ("size", "shape", "data_offsets", "rules", "counts", "format_version", "index", "call")


def _paths(x: Any, at: tuple = (), out: list | None = None, limit: int = 4000) -> list[tuple]:
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    out.append(at)
    if isinstance(x, dict):
        for k, v in x.items():
            _paths(v, at + (k,), out, limit)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _paths(v, at + (i,), out, limit)
    return out


def _get(x: Any, at: tuple) -> Any:
    for k in at:
        x = x[k]
    return x


def _set(root: Any, at: tuple, value: Any) -> Any:
    if not at:
        return value
    _get(root, at[:-1])[at[-1]] = value
    return root


def mutate_json(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """One structural edit of a parsed JSON document; returns (new document, label)."""
    paths = _paths(doc)
    sized = [p for p in paths if p and isinstance(p[-1], str) and p[-1] in _SIZE_KEYS]
    op = rng.choice(["deep", "huge", "wrong_type", "path", "dup_key", "unknown_key", "del_key", "rename_key",
                     "huge_count", "huge_declared", "huge_declared"])
    if op == "huge_declared" and sized:
        at = rng.choice(sized)
        cur = _get(doc, at)
        if isinstance(cur, list):
            new: Any = [Raw(rng.choice(_HUGE[1:5])) for _ in cur] or [Raw("1000000000000000")]
        elif isinstance(cur, dict):
            new = {k: Raw(rng.choice(_HUGE)) for k in cur} or {"x": Raw("1000000000000000")}
        else:
            new = Raw(rng.choice(_HUGE))
        return _set(doc, at, new), f"json:huge_declared:{at[-1]}"
    at = rng.choice(paths)
    if op == "deep":
        n = rng.choice([70, 200, 1100, 20000])
        return _set(doc, at, Raw("[" * n + "]" * n) if rng.random() < 0.7 else _nested_tags(n)), "json:deep"
    if op == "huge":
        return _set(doc, at, Raw(rng.choice(_HUGE))), "json:huge_number"
    if op == "wrong_type":
        return _set(doc, at, rng.choice(_WRONG)), "json:wrong_type"
    if op == "path":
        return _set(doc, at, rng.choice(_PATHS)), "json:path"
    dicts = [p for p in paths if isinstance(_get(doc, p), dict) and _get(doc, p)]
    if op in ("dup_key", "unknown_key", "del_key", "rename_key") and dicts:
        at = rng.choice(dicts)
        d = _get(doc, at)
        key = rng.choice(sorted(d))
        if op == "dup_key":
            pairs = Pairs(d.items())
            pairs.insert(rng.randrange(len(pairs) + 1), (key, rng.choice([d[key], *_WRONG[:4]])))
            return _set(doc, at, pairs), "json:dup_key"
        if op == "unknown_key":
            d[rng.choice(["zz_unknown", "__proto__", "$payload", "kind", key + "_"])] = rng.choice(_WRONG)
            return doc, "json:unknown_key"
        if op == "del_key":
            del d[key]
            return doc, "json:del_key"
        d[rng.choice(_PATHS)] = d.pop(key)
        return doc, "json:rename_key"
    lists = [p for p in paths if isinstance(_get(doc, p), list) and _get(doc, p)]
    if lists:
        at = rng.choice(lists)
        items = _get(doc, at)
        reps = rng.choice([2, 50, 2000]) if len(json.dumps(items)) < 2000 else 2
        return _set(doc, at, (items * reps)[:200000]), "json:huge_count"
    return _set(doc, at, Raw(rng.choice(_HUGE))), "json:huge_number"


def _nested_tags(n: int) -> Raw:
    return Raw('{"$tuple":[' * n + "]}" * n)


# ---------------------------------------------------------------------------------------------
# artifact files ------------------------------------------------------------------------------


def _artifact_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def artifact_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in _artifact_files(root))


def _split_safetensors(raw: bytes) -> tuple[Any, bytes] | None:
    if len(raw) < 8:
        return None
    n = int.from_bytes(raw[:8], "little")
    try:
        return json.loads(raw[8:8 + n].decode("utf-8")), raw[8 + n:]
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _join_safetensors(header_text: str, data: bytes) -> bytes:
    head = header_text.encode("utf-8", "surrogatepass")
    return len(head).to_bytes(8, "little") + head + data


def _recompute_manifest(root: Path) -> None:
    """What an attacker does after editing: rewrite every listed file's size and sha256."""
    mpath = root / "manifest.json"
    try:
        m = json.loads(mpath.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        return
    for name in list(m["files"]):
        p = root / name
        if isinstance(name, str) and p.is_file() and root in p.resolve().parents:
            data = p.read_bytes()
            m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    mpath.write_text(json.dumps(m, indent=1))


def _recompute_export_digest(path: Path) -> None:
    from torchlens.io import blobfile, trace_safetensors

    DIGEST_KEY = getattr(trace_safetensors, "DIGEST_KEY", None)
    if DIGEST_KEY is None:  # an export without a content digest: nothing to recompute
        return
    raw = path.read_bytes()
    parts = _split_safetensors(raw)
    if parts is None or not isinstance(parts[0], dict) or not isinstance(parts[0].get("__metadata__"), dict):
        return
    header, data = parts
    meta = header["__metadata__"]
    if not all(isinstance(v, str) for v in meta.values()):
        return
    n = int.from_bytes(raw[:8], "little")
    fake = blobfile.Blob(path.name, {}, {k: v for k, v in meta.items() if k != DIGEST_KEY}, raw)
    meta[DIGEST_KEY] = blobfile.content_digest(fake, DIGEST_KEY, 8 + n)
    path.write_bytes(_join_safetensors(json.dumps(header, separators=(",", ":")), data))


def _json_targets(root: Path) -> list[tuple[Path, str]]:
    """(file, where): 'file' for a JSON file, 'st' for a safetensors header, 'st_meta:<key>'
    for a JSON document stored as a metadata string."""
    out = []
    for p in _artifact_files(root):
        if p.suffix == ".json":
            out.append((p, "file"))
        elif p.suffix == ".safetensors":
            out.append((p, "st"))
            parts = _split_safetensors(p.read_bytes())
            if parts and isinstance(parts[0], dict) and isinstance(parts[0].get("__metadata__"), dict):
                for k, v in parts[0]["__metadata__"].items():
                    if isinstance(v, str) and v[:1] in "{[":
                        out.append((p, f"st_meta:{k}"))
    return out


def mutate(rng: random.Random, root: Path, scratch: Path) -> tuple[str, bool]:
    """Mutate the artifact at `root` in place; return (label, digests recomputed)."""
    files = _artifact_files(root)
    f = rng.choice(files)
    op = rng.choice(["flip", "flip", "byte", "truncate", "extend", "json", "json", "json", "json", "json", "json",
                     "extra_file", "symlink", "delete"])
    label = op
    if op in ("flip", "byte"):
        raw = bytearray(f.read_bytes())
        if raw:
            i = rng.randrange(len(raw))
            raw[i] = raw[i] ^ (1 << rng.randrange(8)) if op == "flip" else rng.randrange(256)
        f.write_bytes(bytes(raw))
    elif op == "truncate":
        raw = f.read_bytes()
        f.write_bytes(raw[:rng.randrange(len(raw) + 1)])
    elif op == "extend":
        with open(f, "ab") as h:
            h.write(rng.choice([b" ", b"\n", b"\x00" * 9, os.urandom(rng.randrange(1, 1024)), b"]}"]))
    elif op == "delete" and not root.is_file():
        f.unlink()
    elif op == "extra_file" and not root.is_file():
        where = rng.choice(["", "blobs/", "records/"])
        d = root / where
        if d.is_dir():
            (d / rng.choice(["evil.json", "payloads-0009.safetensors", "x"])).write_bytes(b"{}")
    elif op == "symlink" and not root.is_file():
        target = scratch / f"outside-{rng.randrange(10**9)}"
        shutil.copy(f, target)
        f.unlink()
        f.symlink_to(target)
    else:
        targets = _json_targets(root)
        if not targets:
            return "none", False
        path, where = rng.choice(targets)
        raw = path.read_bytes()
        if where == "file":
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):
                return "none", False
            doc, label = mutate_json(rng, doc)
            path.write_bytes(render(doc).encode("utf-8", "surrogatepass"))
        else:
            parts = _split_safetensors(raw)
            if parts is None:
                return "none", False
            header, data = parts
            if where == "st":
                header, label = mutate_json(rng, header)
                label = "st_header:" + label
            else:
                key = where.split(":", 1)[1]
                try:
                    inner = json.loads(header["__metadata__"][key])
                except (ValueError, RecursionError):
                    return "none", False
                inner, label = mutate_json(rng, inner)
                header["__metadata__"][key] = render(inner)
                label = "st_meta:" + label
            path.write_bytes(_join_safetensors(render(header), data))
    recompute = rng.random() < 0.5
    if recompute:
        if root.is_file():
            _recompute_export_digest(root)
        else:
            _recompute_manifest(root)
    return label, recompute


# ---------------------------------------------------------------------------------------------
# running the readers -------------------------------------------------------------------------


@dataclass
class Template:
    """One saved artifact to mutate: `path`, `kind` ("tlspec" | "spec" | "safetensors") and
    the object its unmutated load gives (the reference for "equal")."""

    name: str
    path: Path
    kind: str
    reference: Any = None


@dataclass
class HostileReport:
    cases: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    codes: collections.Counter = field(default_factory=collections.Counter)
    mutations: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    max_ratio: float = 0.0
    max_peak: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.cases} cases: typed refusals {self.outcomes['refused']}, equal loads {self.outcomes['equal']}, "
                f"valid attacker-authored loads {self.outcomes['valid_other']}, raw exceptions {self.outcomes['raw']}, "
                f"failures {len(self.failures)}, max peak {self.max_peak} B (max peak/artifact bytes "
                f"{self.max_ratio:.2f}), {self.seconds:.1f} s; codes {dict(self.codes.most_common())}")


def _canon(obj: Any) -> Any:
    """A comparable form of a loaded spec, recipe or safetensors export (traces compare
    with `tl.io.trace_differences`)."""
    import torchlens as tl
    from torchlens.io.trace_safetensors import SafetensorsTrace

    if isinstance(obj, tl.Recipe):
        return ("recipe", obj.digest)
    if isinstance(obj, SafetensorsTrace):
        from torchlens.io.codec import codec_named

        codec = codec_named(obj.header["codec"], obj.header["accuracy"]["backend"])
        tensors = {}
        for k, v in obj.tensors.items():
            e = codec.encode(v)
            tensors[k] = (e.dtype, e.shape, tuple(sorted(e.meta.items())), e.array.tobytes())
        return ("export", json.dumps(_thaw(obj.header), sort_keys=True), tensors)
    recipe = getattr(obj, "recipe", None)
    if recipe is not None:
        return ("spec", obj.kind, obj.level, recipe.digest, tuple((h.helper.name, h.helper.portability, h.helper.qualname)
                                                                  for h in obj.hook_specs))
    return obj


def _thaw(x: Any) -> Any:
    from types import MappingProxyType

    if isinstance(x, MappingProxyType):
        return {k: _thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_thaw(v) for v in x]
    return x


def _equal(ref: Any, got: Any) -> bool:
    import torchlens as tl

    if isinstance(ref, tl.Trace):
        return isinstance(got, tl.Trace) and tl.io.trace_differences(ref, got) == []
    if isinstance(ref, tl.Recipe) or isinstance(got, tl.Recipe):
        # tl.load returns a spec's recipe for kind "recipe": compare rules, not the wrapper
        ref_r = ref if isinstance(ref, tl.Recipe) else getattr(ref, "recipe", None)
        got_r = got if isinstance(got, tl.Recipe) else getattr(got, "recipe", None)
        return ref_r is not None and got_r is not None and ref_r.digest == got_r.digest and type(ref) is type(got)
    return _canon(ref) == _canon(got)


def _load(template: Template, path: Path, rng: random.Random) -> Any:
    import torchlens as tl

    if template.kind == "safetensors":
        return tl.io.read_safetensors(path)
    return tl.load(path, lazy=rng.random() < 0.3) if template.kind == "tlspec" else tl.load(path)


def _run(fn: Callable[[], Any]) -> tuple[str, Any]:
    from torchlens.errors import ERROR_CODES, TorchLensError

    try:
        return "ok", fn()
    except TorchLensError as exc:
        return ("refused", exc.code) if exc.code in ERROR_CODES else ("raw", f"unregistered code {exc.code}")
    except RecursionError as exc:
        return "raw", f"RecursionError: {str(exc)[:120]}"
    except Exception as exc:  # noqa: BLE001 - the failure this harness exists to find
        return "raw", f"{type(exc).__name__}: {str(exc)[:160]}"


def fuzz(templates: list[Template], *, cases: int, seed: int, workdir: Path, alloc_a: float = 64.0,
         alloc_b: int = 8 * 1024 * 1024, seconds: float | None = None) -> HostileReport:
    """Run `cases` seeded mutations over `templates`; see the module docstring. The loads of
    the unmutated templates fill each `Template.reference` and warm caches first. Stops
    early (still a pass) when `seconds` is given and spent."""
    import torchlens as tl

    report = HostileReport()
    for t in templates:
        if t.reference is None:
            t.reference = _load(t, t.path, random.Random(0))
        if t.kind != "safetensors":
            status, value = _run(lambda: tl.validation.validate_tlspec(t.path))
            if status != "ok":
                report.failures.append(f"template {t.name}: validate_tlspec {status} {value!r:.120} but tl.load loads it")
            tl.io.detect_tlspec_format(t.path)
    rng = random.Random(seed)
    start = time.perf_counter()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        for case in range(cases):
            if seconds is not None and time.perf_counter() - start > seconds:
                break
            t = templates[case % len(templates)] if case < len(templates) else rng.choice(templates)
            scratch = workdir / f"c{case}"
            scratch.mkdir(parents=True)
            root = scratch / t.path.name
            if t.path.is_file():
                shutil.copy(t.path, root)
            else:
                shutil.copytree(t.path, root)
            label, recomputed = mutate(rng, root, scratch)
            report.mutations[label.split(":")[0] + (":recomputed" if recomputed else "")] += 1
            size = max(1, artifact_bytes(root))
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            status, value = _run(lambda: _load(t, root, rng))
            peak = tracemalloc.get_traced_memory()[1] - base
            report.max_peak = max(report.max_peak, peak)
            report.max_ratio = max(report.max_ratio, peak / size)
            where = f"case {case} ({t.name}, {label}, digests {'recomputed' if recomputed else 'stale'})"
            if peak > alloc_a * size + alloc_b:
                report.failures.append(f"{where}: peak allocation {peak} B > {alloc_a}*{size}+{alloc_b}")
            if status == "raw":
                report.outcomes["raw"] += 1
                report.failures.append(f"{where}: load raised {value}")
            elif status == "refused":
                report.outcomes["refused"] += 1
                report.codes[value] += 1
            elif _equal(t.reference, value):
                report.outcomes["equal"] += 1
            elif recomputed:
                report.outcomes["valid_other"] += 1
            else:
                report.failures.append(f"{where}: loaded an object that differs from the original with stale digests")
            load_code = value if status == "refused" else None
            value = None
            if t.kind != "safetensors":
                v_status, v_value = _run(lambda: tl.validation.validate_tlspec(root))
                v_code = v_value if v_status == "refused" else None
                if v_status == "raw":
                    report.outcomes["raw"] += 1
                    report.failures.append(f"{where}: validate_tlspec raised {v_value}")
                elif status != "raw" and (v_status == "refused") != (status == "refused"):
                    report.failures.append(f"{where}: validate_tlspec {v_status} ({v_code}) but tl.load {status} ({load_code})")
                elif v_code != load_code:
                    report.failures.append(f"{where}: validate_tlspec refused {v_code}, tl.load {load_code}")
            d_status, d_value = _run(lambda: tl.io.detect_tlspec_format(root))
            if d_status == "raw" or (d_status == "ok" and d_value not in ("v3", "pre_3", "unknown")):
                report.outcomes["raw"] += 1
                report.failures.append(f"{where}: detect_tlspec_format gave {d_status} {d_value!r:.80}")
            report.cases += 1
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["Template", "HostileReport", "fuzz", "mutate", "mutate_json", "render", "artifact_bytes"]
