"""Plugin loading (issue 14 §5): pluggy's entry-point loader, a broken third-party plugin
skipped with a coded warning and a doctor row, a block list, the framework requirement
checked before the framework is imported, appliances served by the same manager.

Broken plugins are real fake distributions: a temporary directory on `sys.path` holding a
`*.dist-info` with `entry_points.txt`, pointing at a module that raises when imported.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends import registry
from torchlens.errors import BackendUnsupportedError, PluginError, PluginWarning
from torchlens.plugins import manager as manager_mod
from torchlens.plugins.manager import PluginManager

BROKEN_MODULE = "tl_fake_broken_plugin"


def fake_distribution(root, dist: str, module: str, source: str, ep_name: str, group: str = "torchlens") -> None:
    """A distribution `dist` 0.1 whose entry point `ep_name` (group `group`) is `module`."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{ep_name} = {module}\n")


@pytest.fixture
def broken_dist(tmp_path, monkeypatch):
    """A distribution whose torchlens plugin raises on import, on sys.path for this test."""
    fake_distribution(tmp_path, "tl-fake-broken", BROKEN_MODULE, "raise RuntimeError('boom: this plugin is broken')\n",
                      "fakebroken")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop(BROKEN_MODULE, None)


@pytest.fixture
def fresh_registry(monkeypatch):
    """A fresh process-wide plugin manager and protocol cache (restored afterwards)."""
    monkeypatch.setattr(manager_mod, "_MANAGER", None)
    monkeypatch.setattr(registry, "_protocols", {})


def _load_quietly(pm: PluginManager) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pm.load()
    return [w for w in rec if isinstance(w.message, PluginWarning)]


def test_broken_plugin_is_skipped_with_a_coded_warning_and_the_rest_load(broken_dist):
    pm = PluginManager()
    with pytest.warns(PluginWarning) as rec:
        specs = pm.backends()
    codes = [w.message.code for w in rec if isinstance(w.message, PluginWarning)]
    assert codes == ["plugin_skipped"]
    msg = rec[0].message
    assert msg.fields["plugin"] == "fakebroken" and msg.fields["distribution"] == "tl-fake-broken"
    assert "boom" in msg.fields["error"] and "TORCHLENS_DISABLE_PLUGINS=fakebroken" in msg.remedy
    assert {"reference", "torch", "jax"} <= set(specs)
    # the second call answers from the same registry: not empty, no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pm.backends() is specs and pm.backends()["reference"].name == "reference"
    [info] = pm.broken
    assert (info.name, info.distribution, info.version, info.status) == ("fakebroken", "tl-fake-broken", "0.1", "broken")


def test_loaded_is_recorded_only_after_loading_finishes(monkeypatch):
    """A load interrupted part-way (here: a KeyboardInterrupt from one entry point) is not
    recorded as done, so the next call loads everything instead of returning an empty registry."""
    pm = PluginManager()
    real = pm._load_entry_point
    calls = {"n": 0}

    def interrupted(ep, group):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(ep, group)

    monkeypatch.setattr(pm, "_load_entry_point", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pm.backends()
    assert {"reference", "torch", "jax"} <= set(pm.backends())


def test_after_a_broken_plugin_trace_works_and_the_doctor_names_it(broken_dist, fresh_registry):
    from torchlens_reference.zoo import zoo

    with pytest.warns(PluginWarning):
        report = tl.report.doctor()
    row = report["plugin:fakebroken"]
    assert row.status == "broken" and "tl-fake-broken 0.1" in row.detail and "boom" in row.detail
    assert "TORCHLENS_DISABLE_PLUGINS=fakebroken" in row.suggestion
    assert report["plugin:reference"].status == "loaded"
    entry = zoo()["mlp"]
    t = tl.trace(entry["model"], *entry["args"], backend="reference")
    assert t.output_ops and t.provenance.backend == "reference"
    np.testing.assert_array_equal(t.output_ops[0].out, entry["model"](*entry["args"]))


def test_a_plugin_whose_hook_raises_is_skipped(tmp_path, monkeypatch):
    src = ("import torchlens\n"
           "@torchlens.hookimpl\n"
           "def torchlens_backends():\n"
           "    raise ValueError('hook exploded')\n")
    fake_distribution(tmp_path, "tl-fake-hook", "tl_fake_hook_plugin", src, "fakehook")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        pm = PluginManager()
        with pytest.warns(PluginWarning) as rec:
            specs = pm.backends()
        assert "hook exploded" in rec[-1].message.fields["error"]
        assert "reference" in specs and [p.name for p in pm.broken] == ["fakehook"]
    finally:
        sys.modules.pop("tl_fake_hook_plugin", None)


def test_a_plugin_with_an_undeclared_hook_is_skipped(tmp_path, monkeypatch):
    src = ("import torchlens\n"
           "@torchlens.hookimpl\n"
           "def torchlens_backendz():\n"
           "    return []\n")
    fake_distribution(tmp_path, "tl-fake-typo", "tl_fake_typo_plugin", src, "faketypo")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        pm = PluginManager()
        with pytest.warns(PluginWarning) as rec:
            pm.load()
        assert "torchlens_backendz" in rec[-1].message.fields["error"]
        assert [p.name for p in pm.broken] == ["faketypo"] and "reference" in pm.backends()
    finally:
        sys.modules.pop("tl_fake_typo_plugin", None)


def test_block_list_keeps_a_plugin_from_being_imported(broken_dist, monkeypatch):
    monkeypatch.setenv("TORCHLENS_DISABLE_PLUGINS", "fakebroken, jax")
    pm = PluginManager()
    assert _load_quietly(pm) == []  # blocked before import: no warning, nothing imported
    assert BROKEN_MODULE not in sys.modules
    assert {p.name: p.status for p in pm.plugins if p.status == "blocked"} == {"fakebroken": "blocked", "jax": "blocked"}
    assert "jax" not in pm.backends() and "reference" in pm.backends()
    pm2 = PluginManager(blocked=["reference"])  # the application's list adds to the environment's
    assert set(pm2.backends()) == set(pm.backends()) - {"reference"} and "torch" in pm2.backends()
    assert _load_quietly(pm2) == []


def test_doctor_shows_blocked_plugins(fresh_registry, monkeypatch):
    monkeypatch.setenv("TORCHLENS_DISABLE_PLUGINS", "jax")
    report = tl.report.doctor()
    assert report["plugin:jax"].status == "blocked" and "TORCHLENS_DISABLE_PLUGINS" in report["plugin:jax"].suggestion
    assert "backend:jax" not in report.keys()


def _spec_with_spy(minimum: str, distributions=("numpy",)):
    calls = []

    def factory():
        calls.append(1)
        raise AssertionError("the factory (which imports the framework) must not run")

    spec = tl.backends.BackendSpec(name="spyfw", maturity="preview", protocol=factory,
                                   framework=tl.backends.FrameworkRequirement(distributions, minimum, extra="spyfw"))
    return spec, calls


@pytest.mark.parametrize("minimum, distributions, code", [
    ("999.0", ("numpy",), "runtime_version_unsupported"),
    ("1.0", ("tl-no-such-framework",), "runtime_missing"),
])
def test_framework_requirement_is_checked_before_the_factory_runs(fresh_registry, minimum, distributions, code):
    spec, calls = _spec_with_spy(minimum, distributions)

    class P:
        @tl.hookimpl
        def torchlens_backends(self):
            return [spec]

    manager_mod.get_plugin_manager().register(P(), "spyfw_plugin")
    with pytest.raises(BackendUnsupportedError) as info:
        tl.backends.get_protocol("spyfw")
    assert info.value.code == code and calls == []
    with pytest.raises(BackendUnsupportedError) as info:
        tl.trace(object(), np.ones(2), backend="spyfw")
    assert info.value.code == code and calls == []


def test_appliances_are_served_by_the_plugin_manager(fresh_registry):
    from torchlens import appliances

    class Kit:
        @tl.hookimpl
        def torchlens_appliances(self):
            return [appliances.ApplianceSpec("kit_test", lambda t: ("kit", t), "a test kit"), ("tuple_kit", lambda t: 1, "")]

    pm = manager_mod.get_plugin_manager()
    pm.register(Kit(), "kit_plugin")
    assert appliances.names()["kit_test"] == "a test kit" and "tuple_kit" in appliances.names()
    assert appliances.bind("kit_test", 7) == ("kit", 7)
    assert {a.name for a in pm.appliances()} >= {"kit_test", "tuple_kit"}
    with pytest.raises(PluginError) as info:
        appliances.register("kit_test", lambda t: t)
    assert info.value.code == "appliance_name_taken"


def test_a_direct_plugin_returning_garbage_appliances_raises(fresh_registry):
    class Bad:
        @tl.hookimpl
        def torchlens_appliances(self):
            return [("Not A Name", 3)]

    pm = manager_mod.get_plugin_manager()
    pm.register(Bad(), "bad_kit")
    with pytest.raises(PluginError) as info:
        pm.appliance_table()
    assert info.value.code == "plugin_invalid"
