"""`tl.Bundle`: named collections of aligned Traces for cross-run comparison (experimental).

Build one with `tl.Bundle()` / `tl.Bundle([t1, t2])` / `tl.Bundle({"clean": t1, ...})`,
compare members with `compare`, read one site across members with `at(site)`, draw the
difference with `draw(graph="diff")`, save it with `save`. See docs/guides/bundles.md.
"""

from torchlens.bundle.alternative import AlternativeCall, AlternativeReport
from torchlens.bundle.binding import TokenBinding, attach_sidecar
from torchlens.bundle.core import Bundle, CompareRows, StoredComparison
from torchlens.bundle.evidence import value_digest
from torchlens.bundle.guard import snapshot_params
from torchlens.bundle.metrics import METRICS
from torchlens.bundle.relations import MemberRelationRow, OpaqueRelationRow, RelationGrade
from torchlens.bundle.tokens import TokenDivergence, TokenPairs
from torchlens.bundle.views import ComparisonMatrix, SuperOp, SuperParam
from torchlens.bundle.why import (BundleProvenance, EpisodeFoldResult, PayloadFidelity, ProvenanceRow, ProvenanceSummary,
                                  ValueResidual, WhyLink, WhyReport)

__all__ = ["Bundle", "CompareRows", "StoredComparison", "snapshot_params", "METRICS", "MemberRelationRow",
           "OpaqueRelationRow", "RelationGrade", "ComparisonMatrix", "SuperOp", "SuperParam", "TokenBinding",
           "TokenDivergence", "TokenPairs", "attach_sidecar", "AlternativeCall", "AlternativeReport",
           "WhyReport", "WhyLink", "PayloadFidelity", "ValueResidual", "ProvenanceRow", "ProvenanceSummary",
           "BundleProvenance", "EpisodeFoldResult", "value_digest"]
