"""The intervention layer's state is a typed object in the trace's slot (issue 14 §4)."""

import warnings

import numpy as np

import torchlens as tl
from torchlens.intervention.state import InterventionState


def _trace():
    from torchlens_reference import nn  # the framework-free reference backend

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return tl.trace(model, np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), backend="reference")


def test_state_is_typed_and_fork_gets_its_own():
    t = _trace()
    assert t._intervention is None  # made on first use
    assert t.recipe.rules == () and isinstance(t._intervention, InterventionState)
    f = t.fork()
    site = next(o.label for o in f.ops if o.kind == "op")
    f.do(site, tl.zero_ablate())
    st, fst = t._intervention, f._intervention
    assert isinstance(fst, InterventionState) and fst is not st
    assert fst.is_fork and not st.is_fork
    assert len(fst.audit) == 1 and st.audit == [] and t.is_pristine and not f.is_pristine
    assert fst.steered_digest == fst.recipe.digest != st.steered_digest  # values reflect the fork's recipe
    g = f.fork()
    assert g._intervention.audit == fst.audit and g._intervention.audit is not fst.audit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g.ops[site].out = g.ops[site].out  # a direct write is evidence on g only
    assert g._intervention.direct_writes == [site] and g.direct_write_dirty and not f.direct_write_dirty
