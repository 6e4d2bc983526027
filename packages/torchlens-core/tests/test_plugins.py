"""Plugin discovery: the toy backend arrives through its entry point alone; bad plugins are typed errors."""

from importlib import metadata

import pytest

import torchlens as tl
from torchlens.backends import BackendSpec, FrameworkRequirement
from torchlens.errors import PluginError
from torchlens.plugins.manager import PluginManager


def test_reference_backend_is_discovered_by_entry_point():
    eps = {ep.name: ep for ep in metadata.entry_points(group="torchlens")}
    assert eps["reference"].value == "torchlens_reference.plugin"
    pm = PluginManager()
    specs = pm.backends()
    assert "reference" in specs and specs["reference"].maturity == "preview"
    info = [p for p in pm.plugins if p.name == "reference"][0]
    assert info.distribution == "torchlens-reference" and info.version == "0.1.0"


def _spec(name):
    return BackendSpec(name=name, maturity="preview", framework=FrameworkRequirement(("numpy",), "1.0"))


def test_duplicate_backend_name_is_a_typed_error():
    class Dup:
        @tl.hookimpl
        def torchlens_backends(self):
            return [_spec("reference")]

    pm = PluginManager()
    pm.load()
    pm.register(Dup(), "dup")
    with pytest.raises(PluginError) as info:
        pm.backends()
    assert info.value.code == "backend_name_duplicate"
    assert info.value.fields["name"] == "reference"


def test_plugin_returning_garbage_is_plugin_invalid():
    class Bad:
        @tl.hookimpl
        def torchlens_backends(self):
            return ["not a spec"]

    pm = PluginManager()
    pm.load()
    pm.register(Bad(), "bad")
    with pytest.raises(PluginError) as info:
        pm.backends()
    assert info.value.code == "plugin_invalid"


def test_plugin_with_unknown_hook_is_plugin_invalid():
    class Unknown:
        @tl.hookimpl
        def torchlens_no_such_hook(self):
            return []

    pm = PluginManager()
    with pytest.raises(PluginError) as info:
        pm.register(Unknown(), "unknown")
    assert info.value.code == "plugin_invalid"


def test_entry_point_that_fails_to_import_is_skipped_and_named():
    """(Issue 14: a broken third-party plugin is skipped with a coded warning, not fatal;
    test_backend_contract_plugins.py covers it with a real fake distribution.)"""
    from torchlens.errors import PluginWarning

    ep = metadata.EntryPoint(name="broken", value="torchlens_no_such_module.plugin", group="torchlens")
    pm = PluginManager()
    with pytest.warns(PluginWarning) as rec:
        pm._load_entry_point(ep, "torchlens")
    assert rec[0].message.code == "plugin_skipped" and "broken" in str(rec[0].message)
    assert [p.status for p in pm.plugins if p.name == "broken"] == ["broken"]


def test_appliance_registry_refusals():
    from torchlens import appliances

    with pytest.raises(PluginError) as info:
        appliances.register("Bad Name", lambda t: t)
    assert info.value.code == "appliance_registration_invalid"
    appliances.register("echo_test", lambda t: ("echo", t))
    with pytest.raises(PluginError) as info:
        appliances.register("echo_test", lambda t: t)
    assert info.value.code == "appliance_name_taken"
    with pytest.raises(PluginError) as info:
        appliances.bind("no_such_appliance", None)
    assert info.value.code == "appliance_unknown"
    assert appliances.bind("echo_test", 5) == ("echo", 5)
