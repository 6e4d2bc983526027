"""tl.viz.contact_sheet: a grid of heatmaps of many sites (and of every Bundle member).

The grid reduction and the block means are checked against hand loops, the colour scale
against min/max (or max |value|) computed here from the members' payloads, and every drawn
rect's fill against its grid element.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import torchlens as tl
from torchlens.bundle import Bundle
from torchlens.errors import InvalidArgumentError, PayloadUnavailableError
from torchlens.viz.contact_sheet import cell_color, diverging_ramp, to_grid
from torchlens.viz.examples import example_trace
from torchlens.viz.ramp import default_ramp


def test_to_grid_shapes_and_block_means():
    assert to_grid(np.ones((1, 1, 4)), 64).shape == (1, 4)
    assert to_grid(np.arange(24.0).reshape(2, 3, 4), 64).shape == (6, 4)
    assert to_grid(np.float32(3.0), 64).shape == (1, 1)
    a = np.arange(130.0).reshape(1, 130)
    g = to_grid(a, 64)  # blocks of ceil(130 / 64) = 3 columns; the last block holds one
    assert g.shape == (1, 44)
    for j in range(44):
        block = [float(v) for v in a[0, 3 * j:3 * j + 3]]
        assert g[0, j] == pytest.approx(sum(block) / len(block))


def _fills(svg: str, site: str, row: str) -> list[str]:
    m = re.search(rf'<g class="cell" data-site="{re.escape(site)}" data-row="{re.escape(row)}"[^>]*>(.*?)</g>', svg, re.S)
    return re.findall(r'fill="([^"]+)"', m.group(1))


def test_bundle_sheet_shares_one_scale_per_site_and_fills_every_element(tmp_path):
    a, b = example_trace("mlp"), example_trace("mlp")
    relu_b = b._ops["relu_1_2"]
    relu_b.replace_outputs((np.abs(relu_b.out) * np.float32(3.0),))  # all >= 0: sequential scale
    lin_a = a._ops["linear_1_1"]
    sheet = tl.viz.contact_sheet(Bundle({"a": a, "b": b}), ["relu_1_2", "linear_1_1"], path=tmp_path / "s.svg")
    assert (tmp_path / "s.svg").read_text() == str(sheet) and len(sheet.cells) == 4
    for site in ("relu_1_2", "linear_1_1"):
        vals = [float(v) for t in (a, b) for v in np.asarray(t._ops[site].out).reshape(-1)]
        lo, hi = min(vals), max(vals)
        diverging = lo < 0 < hi
        for row, t in (("a", a), ("b", b)):
            cell = next(c for c in sheet.cells if c.site == site and c.row == row)
            assert cell.scale == (lo, hi) and cell.diverging == diverging
            want = [cell_color(float(v), lo, hi, diverging) for v in np.asarray(t._ops[site].out).reshape(-1)]
            assert _fills(str(sheet), site, row) == want
    assert lin_a.out.min() < 0 < lin_a.out.max()  # linear outputs take both signs: the diverging ramp
    assert cell_color(0.0, -2.0, 1.0, True) == diverging_ramp()(0.5)
    assert cell_color(-2.0, -2.0, 1.0, True) == diverging_ramp()(0.0)
    assert cell_color(5.0, 1.0, 5.0, False) == default_ramp()(1.0)
    assert cell_color(float("nan"), 0.0, 1.0, False) == "#000000"


def test_trace_sheet_defaults_and_refusals(tmp_path):
    t = example_trace("loop", steps=2)
    sheet = tl.viz.contact_sheet(t, "tanh_1_5")  # a layer label: every pass
    assert [c.site for c in sheet.cells] == ["tanh_1_5:1", "tanh_1_5:2"]
    assert len(tl.viz.contact_sheet(t).cells) == sum(1 for o in t if o.saved and o.kind not in ("input", "output"))
    t._ops["add_1_4:1"].saved = False
    with pytest.raises(PayloadUnavailableError) as e:
        tl.viz.contact_sheet(t, ["add_1_4:1"])
    assert e.value.code == "activation_not_saved"
    with pytest.raises(InvalidArgumentError) as e:
        tl.viz.contact_sheet(t, max_cells=2)
    assert e.value.code == "draw_option_invalid"
    with pytest.raises(InvalidArgumentError) as e:
        tl.viz.contact_sheet(t, ["tanh_1_5:1"], path=tmp_path / "x.png")
    assert e.value.code == "file_format_unsupported" and not (tmp_path / "x.png").exists()
    with pytest.raises(InvalidArgumentError):
        tl.viz.contact_sheet(object())
