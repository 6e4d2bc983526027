"""A pytest plugin that runs the conformance cells, one test per (backend, cell).

Not auto-loaded (no pytest11 entry point): enable it with
`pytest_plugins = ["torchlens_conformance.pytest_plugin"]` in a conftest, or `-p
torchlens_conformance.pytest_plugin`. Parametrized by the installed backends, so a failing
cell names its backend and cell.
"""

from __future__ import annotations

import pytest


def _backend_cells() -> list[tuple[str, str]]:
    import torchlens as tl
    from torchlens_conformance.cells import cells_for

    out = []
    for name in sorted(tl.backends.specs()):
        proto = tl.backends.get_protocol(name)
        if proto.runtime_available() is not None:
            continue
        out += [(name, cell_id) for cell_id in cells_for(proto)]
    return out


def pytest_generate_tests(metafunc):
    if "conformance_case" in metafunc.fixturenames:
        cases = _backend_cells()
        metafunc.parametrize("conformance_case", cases, ids=[f"{b}-{c}" for b, c in cases])


@pytest.fixture
def conformance_outcome(conformance_case):
    from torchlens_conformance.cells import cells_for, make_context, run_cell

    name, cell_id = conformance_case
    ctx = make_context(name)
    return run_cell(ctx, cells_for(ctx.proto)[cell_id])
