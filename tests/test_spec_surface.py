"""Spec surface: every dotted `tl.`/`torchlens.` name in shared/spec/*.md that the built areas
promise resolves in the installed packages, and the list below is kept current (a name that
starts resolving must be added, so coverage only moves forward).

The names are extracted the way `shared/tools/spec_surface.py` extracts them; run this file
with `-s` to print the resolved fraction.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec"

#: Names the built areas provide (glossary, interventions, facets and mech-interp pages).
BUILT = frozenset("""
torchlens.io.attach_sidecar torchlens.Edit torchlens.Recipe torchlens.Selection torchlens.Selector torchlens.add torchlens.add_noise torchlens.all_sites
torchlens.appliances.names torchlens.appliances.register torchlens.backends.BackendProtocol
torchlens.backends.FrameworkRequirement torchlens.backends.REFUSAL_CODES torchlens.backends.VALIDATION_REASONS
torchlens.backends.jax torchlens.backends.mlx torchlens.backends.paddle torchlens.backends.tf torchlens.backends.tinygrad torchlens.backends.torch torchlens.clamp torchlens.clip_norm torchlens.errors.AmbiguousAxisError
torchlens.errors.AmbiguousOpLookupError torchlens.errors.ReentrantTraceError torchlens.export torchlens.export.safetensors
torchlens.func torchlens.grad torchlens.in_module torchlens.intervention.BoundModel torchlens.intervention.Population torchlens.intervention.Rule torchlens.intervention.compose
torchlens.intervention.keep_grad torchlens.intervention.scramble_elements torchlens.intervention.set_affine_coordinates
torchlens.intervention.subspace_ablate torchlens.intervention.subspace_interchange torchlens.io.detect_tlspec_format
torchlens.io.load_intervention_spec torchlens.io.read_safetensors torchlens.io.save_intervention torchlens.label
torchlens.label_contains torchlens.label_matches torchlens.load torchlens.mean_ablate torchlens.mechinterp torchlens.mechinterp.FixedPeriodInduction torchlens.mechinterp.component_graph torchlens.mechinterp.patch_edges torchlens.mechinterp.edge_scores
torchlens.mechinterp.circuit_performance_ratio torchlens.mechinterp.circuit_model_difference
torchlens.model_input torchlens.model_output torchlens.module torchlens.options torchlens.options.CaptureOptions
torchlens.options.InterventionOptions torchlens.patch_from torchlens.positions torchlens.project_onto
torchlens.project_out torchlens.replace_with torchlens.report.doctor torchlens.scale torchlens.splice_module torchlens.steer torchlens.subspace
torchlens.sweep torchlens.trace torchlens.types torchlens.types.AttributeWrite torchlens.types.UnencodableValue
torchlens.types.Quantity torchlens.types.Bytes torchlens.types.Duration torchlens.types.Flops torchlens.types.Macs
torchlens.units torchlens.validate
torchlens.validation.validate_forward_pass torchlens.validation.validate_tlspec torchlens.viz.Drawing torchlens.when
torchlens.where torchlens.zero_ablate
torchlens.Bundle torchlens.bundle torchlens.types.Relationship torchlens.viz.contact_sheet
torchlens.errors.quiet torchlens.types.TraceLike torchlens.fingerprint torchlens.fingerprint.assert_unchanged
torchlens.facet torchlens.head torchlens.facets torchlens.facets.adding torchlens.facets.child_output_spec
torchlens.facets.config_value torchlens.facets.describe torchlens.facets.enable_transformer_lens_aliases
torchlens.facets.functions torchlens.facets.register torchlens.facets.reset torchlens.facets.transformer_lens_aliases_enabled
torchlens.facets.coverage torchlens.facets.patching torchlens.facets.patching.activation_patch_attention_heads
torchlens.facets.patching.attribution_patch_attention_heads
torchlens.dataset_extraction.TokenRows torchlens.extract torchlens.extract_dataset torchlens.pluck torchlens.stats
torchlens.stats.CKA torchlens.stats.Covariance torchlens.stats.CrossCovariance torchlens.stats.Histogram torchlens.stats.Mean
torchlens.stats.Norm torchlens.stats.PCA torchlens.stats.Quantile torchlens.stats.RunningStats torchlens.stats.StreamingStat
torchlens.stats.TopK torchlens.stats.UnitTopK torchlens.stats.aggregate torchlens.stats.cosine_distance
torchlens.stats.load_fitted torchlens.stats.relative_l1 torchlens.stats.relative_l2 torchlens.stats.save_fitted
torchlens.stats.site_stats
torchlens.record torchlens.recording torchlens.recording.GenerationOptions torchlens.recording.Recorder
torchlens.recording.reducers torchlens.types.RecordingSettings
torchlens.distributed.ArmingRecord torchlens.distributed.GroupIdentity torchlens.distributed.arm torchlens.merge_ranks
torchlens.merge_report
""".split())


def spec_names() -> set[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SPEC.glob("*.md")))
    names = set()
    for m in re.finditer(r"\b(tl|torchlens)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text):
        path = "torchlens" + m.group(2)
        if not path.endswith(("_", ".")):
            names.add(path)
    return {n for n in names if not re.search(r"\.(md|py|json|txt)$", n) and "._" not in n}


def resolves(path: str) -> bool:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        for attr in parts[i:]:
            try:
                obj = getattr(obj, attr)
            except Exception:
                return False
        return True
    return False


@pytest.fixture(scope="module")
def names() -> set[str]:
    if not SPEC.is_dir():
        pytest.skip("shared/spec is not beside this checkout")
    return spec_names()


def test_every_built_name_is_in_the_spec_and_resolves(names):
    assert BUILT <= names, f"not spec names: {sorted(BUILT - names)}"
    missing = sorted(n for n in BUILT if not resolves(n))
    assert not missing, f"spec names the built areas promise but that do not resolve: {missing}"


def test_the_built_list_is_current(names):
    resolved = {n for n in names if resolves(n)}
    print(f"\nspec surface: {len(resolved)} of {len(names)} names resolve ({len(resolved) / len(names):.0%})")
    assert resolved <= BUILT, f"resolve now; add them to BUILT: {sorted(resolved - BUILT)}"
