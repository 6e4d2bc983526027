"""Spec fidelity round 3 (issue 13): error codes the spec cites for built areas, each
reproduced at its raise site."""

import hashlib
import json

import pytest

import torchlens as tl


def _renamed_spec(tmp_path, old_name: str):
    """A saved spec whose rule names a removed helper spelling (manifest digest patched)."""
    path = tl.io.save_intervention(tl.when("relu_1_2", tl.mean_ablate(dim=0)), tmp_path / f"{old_name}.tlspec")
    doc = json.loads((path / "intervention.json").read_bytes())
    doc["rules"][0]["edit"]["name"] = old_name
    body = json.dumps(doc).encode()
    (path / "intervention.json").write_bytes(body)
    m = json.loads((path / "manifest.json").read_bytes())
    m["files"]["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (path / "manifest.json").write_text(json.dumps(m))
    return path


@pytest.mark.parametrize("old_name,new_name", [("mean_fill", "mean_ablate"), ("resample_ablate", "scramble_elements")])
def test_a_saved_spec_naming_a_removed_helper_says_it_was_renamed(tmp_path, old_name, new_name):
    """glossary l. 766, 779: a saved spec naming mean_fill / resample_ablate raises
    intervention_helper_renamed (not the generic unknown-helper refusal), naming the new spelling."""
    path = _renamed_spec(tmp_path, old_name)
    for load in (tl.io.load_intervention_spec, tl.load):
        with pytest.raises(tl.errors.ArtifactError) as info:
            load(path)
        assert info.value.code == "intervention_helper_renamed"
        assert info.value.fields["helper"] == old_name and info.value.fields["replacement"] == new_name
        assert new_name in info.value.remedy
