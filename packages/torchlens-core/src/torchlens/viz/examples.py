"""Small framework-free traces built from hand-made events, for docs, tests and benchmarks.

`example_trace("mlp")`, `example_trace("loop", steps=4)` and
`example_trace("blocks", n_blocks=8)`, `example_trace("detection", n_dets=400)` return real `Trace`s whose payloads are NumPy arrays,
with a tiny NumPy backend object providing `host_copy`. They exercise the same builder a
backend uses, so drawings and tables of them read exactly like a captured model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.build import EventLog, ModelInfo, ModuleEnter, ModuleExit, ModuleInfo, OpEvent, ParamInfo, build_trace
from torchlens.records.trace import Provenance, Trace


class NumpyBackend:
    """The value members a view needs, for NumPy payloads."""

    name = "numpy"

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def host_copy(self, value: Any) -> np.ndarray:
        return np.array(value, copy=True)


class EventBuilder:
    """Append events the way a backend would: modules, params, inputs, ops, outputs."""

    def __init__(self, root_class: str, seed: int = 0) -> None:
        self.log = EventLog()
        self.info = ModelInfo(root_class, modules=[ModuleInfo("self", root_class)])
        self._known = {"self"}
        self._calls: dict[str, int] = {"self": 1}
        self.stack: list[tuple[str, int]] = [("self", 1)]
        self.rng = np.random.default_rng(seed)
        self._values: dict[int, np.ndarray] = {}
        self.log.append(ModuleEnter("self", 1))

    def module(self, address: str, class_name: str) -> None:
        if address not in self._known:
            self._known.add(address)
            self.info.modules.append(ModuleInfo(address, class_name))

    def param(self, address: str, shape: tuple[int, ...], trainable: bool = True) -> str:
        module, _, name = address.rpartition(".")
        if not any(p.address == address for p in self.info.params):
            self.info.params.append(ParamInfo(address, module or "self", name, shape, "float32", trainable,
                                              self.rng.standard_normal(shape).astype(np.float32)))
        return address

    def enter(self, address: str, class_name: str, inputs: tuple[int, ...] = ()) -> None:
        self.module(address, class_name)
        n = self._calls.get(address, 0) + 1
        self._calls[address] = n
        self.log.append(ModuleEnter(address, n, tuple((i, 0) for i in inputs)))
        self.stack.append((address, n))

    def exit(self, output: int) -> None:
        address, n = self.stack.pop()
        self.log.append(ModuleExit(address, n, ((output, 0),)))

    def input(self, shape: tuple[int, ...], path: str = "x") -> int:
        i = self.log.new_id()
        v = self.rng.standard_normal(shape).astype(np.float32)
        self._values[i] = v
        self.log.append(OpEvent(i, "input", "input", outputs=(v,), shapes=(shape,), dtypes=("float32",), path=path))
        return i

    def op(self, func: str, parents: tuple[int, ...], shape: tuple[int, ...], site: str,
           params: tuple[str, ...] = (), meta: dict[str, Any] | None = None) -> int:
        i = self.log.new_id()
        v = self.rng.standard_normal(shape).astype(np.float32)
        self.log.append(OpEvent(i, "op", func, parents=tuple((p, 0) for p in parents), outputs=(v,), shapes=(shape,),
                                dtypes=("float32",), module_stack=tuple(self.stack), site=site, params=params,
                                meta=dict(meta or {})))
        return i

    def linear(self, x: int, address: str, n_in: int, n_out: int, lead: tuple[int, ...] = (1,),
               site: str = "linear") -> int:
        self.enter(address, "Linear", (x,))
        w = self.param(f"{address}.weight", (n_out, n_in))
        b = self.param(f"{address}.bias", (n_out,))
        batch = int(np.prod(lead))
        macs = batch * n_in * n_out
        y = self.op("linear", (x,), lead + (n_out,), site, params=(w, b),
                    meta={"macs": macs, "flops": 2 * macs + batch * n_out, "duration_s": 1e-6 * (1 + macs / 1e4)})
        self.exit(y)
        return y

    def output(self, parent: int, path: str = "output") -> int:
        o = self.log.new_id()
        self.log.append(OpEvent(o, "output", "output", parents=((parent, 0),), outputs=(None,), shapes=(None,),
                                dtypes=("float32",), path=path, saved=False))
        return o

    def build(self, output_id: int | None = None) -> Trace:
        self.log.append(ModuleExit("self", 1, ((output_id, 0),) if output_id is not None else ()))
        return build_trace(self.info, self.log, provenance=Provenance("numpy", model_class=self.info.root_class),
                           backend=NumpyBackend())


def _mlp(width: int) -> Trace:
    b = EventBuilder("MLP")
    x = b.input((1, width))
    h = b.linear(x, "fc1", width, 2 * width)
    h = b.op("relu", (h,), (1, 2 * width), "relu")
    y = b.linear(h, "fc2", 2 * width, width)
    out = b.output(y)
    return b.build(y if out is not None else None)


def _loop(steps: int, width: int) -> Trace:
    b = EventBuilder("LoopRNN")
    x = b.input((1, width))
    h = b.op("zeros", (), (1, width), "h0")
    for _ in range(steps):
        b.enter("cell", "Cell", (x, h))
        a = b.linear(x, "cell.ih", width, width, site="ih")
        c = b.linear(h, "cell.hh", width, width, site="hh")
        s = b.op("add", (a, c), (1, width), "add")
        h = b.op("tanh", (s,), (1, width), "tanh")
        b.exit(h)
    y = b.linear(h, "head", width, 2)
    b.output(y)
    return b.build(y)


def _blocks(n_blocks: int, width: int) -> Trace:
    b = EventBuilder("TinyTransformer")
    x = b.input((1, 4, width), path="tokens")
    h = b.op("embedding", (x,), (1, 4, width), "embed")
    for i in range(n_blocks):
        blk = f"blocks.{i}"
        b.enter(blk, "Block", (h,))
        b.enter(f"{blk}.ln1", "LayerNorm", (h,))
        n = b.op("layer_norm", (h,), (1, 4, width), "ln", params=(b.param(f"{blk}.ln1.weight", (width,)),))
        b.exit(n)
        b.enter(f"{blk}.attn", "Attention", (n,))
        q = b.linear(n, f"{blk}.attn.q", width, width, (1, 4), site="q")
        k = b.linear(n, f"{blk}.attn.k", width, width, (1, 4), site="k")
        v = b.linear(n, f"{blk}.attn.v", width, width, (1, 4), site="v")
        s = b.op("matmul", (q, k), (1, 4, 4), "qk", meta={"macs": 16 * width, "flops": 32 * width})
        p = b.op("softmax", (s,), (1, 4, 4), "softmax")
        a = b.op("matmul", (p, v), (1, 4, width), "pv", meta={"macs": 16 * width, "flops": 32 * width})
        o = b.linear(a, f"{blk}.attn.proj", width, width, (1, 4), site="proj")
        b.exit(o)
        h = b.op("add", (h, o), (1, 4, width), "res1")
        b.enter(f"{blk}.mlp", "MLP", (h,))
        u = b.linear(h, f"{blk}.mlp.up", width, 2 * width, (1, 4), site="up")
        g = b.op("gelu", (u,), (1, 4, 2 * width), "gelu")
        d = b.linear(g, f"{blk}.mlp.down", 2 * width, width, (1, 4), site="down")
        b.exit(d)
        h = b.op("add", (h, d), (1, 4, width), "res2")
        b.exit(h)
    y = b.linear(h, "head", width, 10, (1, 4))
    b.output(y)
    return b.build(y)


def _detection(n_dets: int, width: int) -> Trace:
    """The shape that makes Mask R-CNN slow to lay out: a backbone, then a per-detection
    loop (torchvision's `paste_masks_in_image`) whose every pass reads the early feature map
    and the image, and a final `stack` reading every pass: edges that span many ranks."""
    b = EventBuilder("MaskRCNNLike")
    x = b.input((1, 3, 32, 32), path="images")
    h = x
    b.enter("backbone", "Backbone", (x,))
    for i in range(12):
        h = b.op("conv2d", (h,), (1, width, 8, 8), f"conv{i}")
        h = b.op("relu", (h,), (1, width, 8, 8), f"relu{i}")
    b.exit(h)
    feats = h
    b.enter("heads", "RoIHeads", (feats,))
    scores = b.op("linear", (feats,), (n_dets,), "scores")
    pasted = []
    for _ in range(n_dets):
        box = b.op("getitem", (scores,), (4,), "box")
        m = b.op("interpolate", (feats, box), (1, 1, 16, 16), "resize")
        m = b.op("sigmoid", (m,), (1, 1, 16, 16), "sigmoid")
        z = b.op("zeros", (x,), (32, 32), "canvas")
        w = b.op("setitem", (z, m), (32, 32), "paste")
        pasted.append(b.op("gt", (w,), (32, 32), "threshold"))
    y = b.op("stack", tuple(pasted), (n_dets, 32, 32), "stack")
    b.exit(y)
    b.output(y)
    return b.build(y)


def example_trace(kind: str = "mlp", *, steps: int = 3, n_blocks: int = 2, width: int = 8,
                  n_dets: int = 400) -> Trace:
    """A hand-built Trace: "mlp" (two linears), "loop" (a cell run `steps` times, a
    recurrent layer per op), "blocks" (`n_blocks` transformer-like blocks, 16 ops each) or
    "detection" (a backbone and a per-detection loop of `n_dets` passes, 6 ops each, with
    long edges back to the feature map: the layout cost of Mask R-CNN)."""
    if kind == "detection":
        return _detection(n_dets, width)
    if kind == "mlp":
        return _mlp(width)
    if kind == "loop":
        return _loop(steps, width)
    if kind == "blocks":
        return _blocks(n_blocks, width)
    from torchlens.errors import InvalidArgumentError

    raise InvalidArgumentError("invalid_argument", f"no example trace {kind!r}", remedy="use 'mlp', 'loop', 'blocks' or 'detection'")
