"""Trace.draw on real torch models: GPT-2 (12 blocks, random init) folded and unfolded, a
ResNet-like CNN, and an LSTM-cell loop rolled and unrolled, rendered to SVG and PNG.

Node and cluster counts are recomputed here from the public records (op.module_calls,
trace.layers, trace.modules), independently of the drawing code.
"""

from __future__ import annotations

import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchlens_torch")
from torch import nn  # noqa: E402

import torchlens as tl  # noqa: E402

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")


def expected_counts(trace, depth=None, rolled=False):
    """(nodes, clusters) the drawing rules give: a module call at nesting depth `depth` is
    one box; a frame is drawn around a module call (module, when rolled) holding two or
    more drawn nodes."""
    units = []
    if rolled:
        for layer in trace.layers:
            units.append((layer.label, tuple(a for a in layer.modules if a != "self")))
    else:
        for op in trace:
            units.append((op.label, tuple(c for c, a in zip(op.module_calls, op.modules) if a != "self")))
    nodes: dict[str, tuple[str, ...]] = {}
    for key, stack in units:
        if depth is not None and len(stack) >= depth:
            nodes.setdefault("box:" + stack[depth - 1], stack[: depth - 1])
        else:
            nodes.setdefault(key, stack)
    beneath: dict[str, int] = {}
    for frames in nodes.values():
        for f in frames:
            beneath[f] = beneath.get(f, 0) + 1
    return len(nodes), sum(1 for n in beneath.values() if n >= 2)


def svg_counts(path):
    text = open(path, encoding="utf-8").read()
    return len(re.findall(r'class="node"', text)), len(re.findall(r'class="cluster"', text))


@pytest.fixture(scope="module")
def gpt2_trace():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=2, n_positions=32, vocab_size=100,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    return tl.trace(model, torch.randint(0, 100, (1, 8)))


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(Residual(8), Residual(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer1(self.stem(x))), 1))


class LoopLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(6, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 12)
        c = torch.zeros(x.shape[0], 12)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


@pytest.fixture(scope="module")
def resnet_trace():
    torch.manual_seed(0)
    return tl.trace(TinyResNet().eval(), torch.randn(1, 3, 16, 16))


@pytest.fixture(scope="module")
def lstm_trace():
    torch.manual_seed(0)
    return tl.trace(LoopLSTM().eval(), torch.randn(2, 5, 6))


@pytest.mark.parametrize("depth", [1, 2, None])
def test_gpt2_counts(gpt2_trace, depth, tmp_path):
    d = gpt2_trace.draw(tmp_path / "gpt2.dot", depth=depth)
    nodes, clusters = expected_counts(gpt2_trace, depth)
    assert (d.num_nodes, d.num_clusters) == (nodes, clusters)


def test_gpt2_depth2_draws_the_12_blocks(gpt2_trace, tmp_path):
    d = gpt2_trace.draw(tmp_path / "g2.dot", depth=2)
    blocks = [f"transformer.h.{i}" for i in range(12)]
    for b in blocks:
        assert f"<B>{b}</B>" in str(d)
    assert str(d).count("GPT2Block") == 12
    assert gpt2_trace.draw(tmp_path / "g1.dot", depth=1).num_nodes < d.num_nodes < gpt2_trace.num_ops


@needs_dot
@pytest.mark.parametrize("depth", [1, 2, None])
def test_gpt2_renders_svg_and_png(gpt2_trace, depth, tmp_path):
    nodes, clusters = expected_counts(gpt2_trace, depth)
    d = gpt2_trace.draw(tmp_path / "gpt2.svg", depth=depth, show_legend=True)
    assert svg_counts(d.path) == (nodes, clusters)
    png = gpt2_trace.draw(tmp_path / "gpt2.png", depth=depth)
    assert open(png.path, "rb").read(8).startswith(b"\x89PNG")


@needs_dot
def test_resnet(resnet_trace, tmp_path):
    for depth in (None, 1, 2):
        nodes, clusters = expected_counts(resnet_trace, depth)
        d = resnet_trace.draw(tmp_path / f"resnet_{depth}.svg", depth=depth)
        assert svg_counts(d.path) == (nodes, clusters)
    png = resnet_trace.draw(tmp_path / "resnet.png", show_legend=True, color_by="flops")
    assert open(png.path, "rb").read(8).startswith(b"\x89PNG")
    assert png.encoding["color"].values


@needs_dot
def test_lstm_loop_rolled_and_unrolled(lstm_trace, tmp_path):
    multi = [l for l in lstm_trace.layers if l.num_passes > 1]
    assert multi and all(l.num_passes == 5 for l in multi)
    un = lstm_trace.draw(tmp_path / "lstm.svg")
    ro = lstm_trace.draw(tmp_path / "lstm_rolled.svg", rolled=True)
    assert svg_counts(un.path) == expected_counts(lstm_trace)
    assert svg_counts(ro.path) == expected_counts(lstm_trace, rolled=True)
    assert ro.num_nodes == len(lstm_trace.layers) < un.num_nodes == lstm_trace.num_ops
    assert "(x5)" in str(ro)
    for name, kw in [("lstm.png", {}), ("lstm_rolled.png", {"rolled": True}),
                     ("lstm_stacked.png", {"stack_by": True, "direction": "LR"})]:
        d = lstm_trace.draw(tmp_path / name, **kw)
        assert open(d.path, "rb").read(8).startswith(b"\x89PNG")


def test_summary_and_tables_on_torch(resnet_trace):
    text = resnet_trace.summary()
    assert "conv2d" in text and "FLOPs" in text
    df = resnet_trace.to_pandas()
    assert len(df) == resnet_trace.num_ops
    html = resnet_trace._repr_html_()
    assert "min " in html  # values shown through the backend's host_copy
    op = next(o for o in resnet_trace if o.func_name == "conv2d")
    assert "conv2d" in op._repr_html_()

