"""Wrong answers in the torch capture and rerun (issue 12 §3, and issue 13's interceptor items).

Every test reproduces one finding against an oracle that does not use TorchLens: a plain
forward with `register_forward_hook` edits, or values computed by hand. Each failed on the
code before the fix (noted per test).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens.errors import (
    InterventionError,
    InvalidArgumentError,
    PayloadUnavailableError,
    ReplayPreconditionError,
    ValidationError,
)
from torchlens.options import CaptureOptions
from torchlens_torch.real_zoo import DataclassOut


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def _hooked(model: nn.Module, site: str, edit, *args):
    """The oracle: a plain forward with `edit` applied to module `site`'s output by a hook."""
    h = model.get_submodule(site).register_forward_hook(lambda m, i, o: edit(o))
    try:
        with torch.no_grad():
            return model(*args)
    finally:
        h.remove()


# in-place writes through a view -----------------------------------------------------------

class ViewWrites(nn.Module):
    """torchvision `batch_images`: pad by writing into a view of a zero buffer, read the base;
    then zero a diagonal through a view and read the base again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        buf = x.new_zeros(x.shape[0], 8)
        buf[:, :4].copy_(h)
        y = self.head(buf)
        m = torch.outer(y[0], y[0])
        m.diagonal().zero_()
        return y + m.sum(0)


def test_a_write_through_a_view_is_a_new_version_of_its_base():
    # before: head read `new_zeros` (the pre-write buffer) and a replay edit at fc never reached it
    torch.manual_seed(0)
    model, x = ViewWrites(), torch.randn(2, 8)
    trace = _quiet(tl.trace, model, x)
    head_input = trace.modules["head"].calls[0].ops[0]
    (parent,) = head_input.parents
    assert trace.ops[parent].func_name == "as_strided_scatter"  # the buffer after the write
    assert torch.equal(trace.ops[parent].out[:, :4], trace.modules["fc"].calls[0].out)
    assert trace.validate_forward_pass(), trace.validation_replay_status
    for edit, oracle in ((tl.scale(3.0), lambda o: o * 3.0), (tl.zero_ablate(), torch.zeros_like)):
        fork = _quiet(trace.fork().do, tl.module("fc"), edit)
        want = _hooked(model, "fc", oracle, x)
        assert torch.equal(fork.output_ops[0].out, want)


def test_the_base_after_a_view_write_is_an_edit_site_on_every_engine():
    # before: the buffer after `buf[:, :4].copy_(h)` was no op, so nothing could edit what head read
    torch.manual_seed(1)
    model, x = ViewWrites(), torch.randn(2, 8)
    with torch.no_grad():  # the oracle by hand: head reads an all-zero buffer
        y = model.head(torch.zeros(2, 8))
        m = torch.outer(y[0], y[0])
        m.diagonal().zero_()
        want = y + m.sum(0)
    trace = _quiet(tl.trace, model, x)
    site = tl.func("as_strided_scatter") & tl.in_module("self")
    first = [o.label for o in trace[site]][0]  # the padded buffer (the diagonal write comes second)
    replayed = _quiet(trace.fork().do, first, tl.zero_ablate())
    rerun = _quiet(trace.fork().do, first, tl.zero_ablate(), model=model, inputs=x)
    live = _quiet(tl.trace, model, x, intervene=tl.when(first, tl.zero_ablate()))
    for got in (replayed, rerun, live):
        assert torch.allclose(got.output_ops[0].out, want, rtol=0, atol=1e-6)
    assert torch.equal(rerun.output_ops[0].out, live.output_ops[0].out)


class StridedBaseWrite(nn.Module):
    def forward(self, x):
        base = torch.empty_strided((3, 4), (1, 3))  # a non-contiguous tensor that is no view
        base.copy_(x)
        base[:, :2].mul_(2)
        return base.sum(0)


def test_a_write_through_a_view_of_a_strided_base_refuses_replay_typed():
    x = torch.randn(3, 4)
    trace = _quiet(tl.trace, StridedBaseWrite(), x)
    with pytest.raises(ValidationError) as e:
        trace.validate_forward_pass()
    assert e.value.code == "validation_unavailable" and e.value.fields["reason"] == "view_write_base_layout"
    with pytest.raises(ReplayPreconditionError) as e:
        trace.fork().do(trace.ops[1].label, tl.scale(2.0))  # the input's copy into the base
    assert e.value.code == "replay_op_unsupported"


# module outputs keep their slot ------------------------------------------------------------

class Router(nn.Module):
    def forward(self, x):
        return torch.topk(x, 2, dim=-1)[1]


class MaxBoth(nn.Module):
    def forward(self, x):
        values, indices = torch.max(x, dim=-1)
        return values, indices


class Slots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.router, self.both = nn.Linear(8, 8), Router(), MaxBoth()

    def forward(self, x):
        h = self.fc(x)
        idx = self.router(h)
        v, i = self.both(h)
        return h.gather(-1, idx).sum(-1) + v + i


def test_module_outputs_keep_their_slot(tmp_path):
    # before: the router's call returned the whole (values, indices) pair and MaxBoth's call one op
    torch.manual_seed(0)
    model, x = Slots(), torch.randn(3, 8)
    seen = {}
    hs = [model.get_submodule(a).register_forward_hook(lambda m, i, o, a=a: seen.__setitem__(a, o))
          for a in ("router", "both")]
    model(x)
    for h in hs:
        h.remove()
    trace = _quiet(tl.trace, model, x)
    loaded_path = tmp_path / "t.tlspec"
    trace.save(loaded_path)
    for t in (trace, tl.load(loaded_path)):
        router = t.modules["router"].calls[0]
        assert isinstance(router.out, torch.Tensor) and torch.equal(router.out, seen["router"])
        assert [s for _, s in router.output_slots] == [1]
        both = t.modules["both"].calls[0]
        assert len(both.out) == 2 and all(torch.equal(a, b) for a, b in zip(both.out, seen["both"]))
        assert [s for _, s in both.output_slots] == [0, 1]


# rerun and intervene= run on copies ----------------------------------------------------------

class WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)  # a forward that writes its input in place
        return self.b(torch.relu(self.a(x)))


def test_rerun_and_intervene_run_on_copies_of_the_inputs():
    # before: the structure run doubled the caller's x, the edited run doubled it again
    torch.manual_seed(0)
    model, x = WritesInput(), torch.randn(2, 4)
    x0 = x.clone()
    want = _hooked(model, "a", lambda o: o * 0.5, x0.clone())
    trace = _quiet(tl.trace, model, x0.clone())
    got = _quiet(trace.fork().do, tl.module("a"), tl.scale(0.5), model=model, inputs=x)
    assert torch.equal(x, x0)
    assert torch.equal(got.output_ops[0].out, want)
    live = _quiet(tl.trace, model, x, intervene=tl.when(tl.module("a"), tl.scale(0.5)))
    assert torch.equal(x, x0)
    assert torch.equal(live.output_ops[0].out, want)


class MakesGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if not x.requires_grad:
            x.requires_grad_()
        return self.b(torch.relu(self.a(x)))


def test_requires_grad_written_by_the_forward_does_not_shift_the_edit():
    # before: the structure run set requires_grad on the caller's x, the edited run recorded one
    # op fewer and the edit meant for relu landed on the second linear (a rerun_graph_diverged warning)
    torch.manual_seed(0)
    model, x = MakesGrad(), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x.clone())
    relu = trace.ops["relu_1_3"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divergence warning either
        got = trace.fork().do(relu.label, tl.zero_ablate(), model=model, inputs=x)
    assert not x.requires_grad
    assert torch.equal(got.ops["relu_1_3"].out, torch.zeros(2, 4))
    assert torch.equal(got.output_ops[0].out.detach(), model.b.bias.detach().expand(2, 4))


_CALLS = [0]


class Unsteady(nn.Module):
    """Its graph depends on how often it ran (a module-level counter a capture cannot restore),
    or, with `branch=True`, on the value of `fc`'s output."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.branch:
            h = torch.tanh(h) if bool(h.sum() > 0) else torch.sigmoid(h)
        else:
            _CALLS[0] += 1
            if _CALLS[0] % 2:
                h = h * 1.0
        return self.out(torch.relu(h))


def test_rerun_refuses_a_graph_that_diverges_at_or_before_an_edit():
    # before: only a rerun_graph_diverged warning, and the edit sat on whatever op took its place
    torch.manual_seed(0)
    model, x = Unsteady(), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x)
    before = {lb: op.out.clone() for lb, op in trace.ops.items() if op.saved}
    with pytest.raises(InterventionError) as e:
        trace.do(tl.func("relu"), tl.zero_ablate(), model=model, inputs=x)
    assert e.value.code == "rerun_graph_diverged" and e.value.fields["edited"]
    assert all(torch.equal(trace.ops[lb].out, v) for lb, v in before.items())  # nothing adopted
    assert trace.is_pristine


def test_an_edit_that_changes_the_graph_downstream_keeps_the_edited_run():
    torch.manual_seed(0)
    model, x = Unsteady(branch=True), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x)
    sign = -1.0 if bool(model.fc(x).sum() > 0) else 1.0  # flips the branch
    want = _hooked(model, "fc", lambda o: o * sign * 10, x)
    with pytest.warns(RuntimeWarning, match=r"\[rerun_graph_diverged_downstream\]"):
        got = trace.fork().do(tl.module("fc"), tl.scale(sign * 10), model=model, inputs=x)
    assert torch.equal(got.output_ops[0].out, want)


# dataclass returns ---------------------------------------------------------------------------

# the model returning a @dataclass is the real-model zoo's `DataclassOut`


def test_a_dataclass_return_is_a_container_of_outputs():
    # before: output_ops == [] and tl.model_output() matched nothing
    torch.manual_seed(0)
    model, x = DataclassOut(), torch.randn(2, 8)
    want = model(x)
    trace = _quiet(tl.trace, model, x)
    outs = trace.output_ops
    assert [o.path for o in outs] == ["output.logits", "output.hidden"]
    assert torch.equal(outs[0].out, want.logits) and torch.equal(outs[1].out, want.hidden)
    assert [o.label for o in trace[tl.model_output()]] == [o.label for o in outs]
    assert [o.label for o in trace[tl.model_output("output.hidden")]] == [outs[1].label]
    fork = _quiet(trace.fork().do, tl.module("head"), tl.zero_ablate())
    assert torch.equal(fork.output_ops[0].out, torch.zeros(2, 4))


class DataclassSub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = DataclassOut()

    def forward(self, x):
        o = self.sub(x)
        return o.logits.sum(-1) + o.hidden.sum(-1)


def test_a_module_returning_a_dataclass_is_an_edit_site_for_bound_and_captured_edits():
    # before: the bound executor zero-fired (bind_zero_fire) and the module call had no outputs
    torch.manual_seed(0)
    model, x = DataclassSub(), torch.randn(2, 8)
    recipe = tl.when(tl.module("sub"), tl.zero_ablate())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bound = recipe.bind(model)(x)
    assert torch.equal(bound, torch.zeros(2))
    trace = _quiet(tl.trace, model, x)
    assert len(trace.modules["sub"].calls[0].output_labels) == 2
    assert torch.equal(_quiet(trace.fork().do, tl.module("sub"), tl.zero_ablate()).output_ops[0].out, torch.zeros(2))


# data-dependent shapes ------------------------------------------------------------------------

class DataDependent(nn.Module):
    """Mask R-CNN's mask paste: an upsample size computed from a box's values via `int(t)`."""

    def __init__(self) -> None:
        super().__init__()
        self.box, self.mask = nn.Linear(4, 2), nn.Linear(4, 4)

    def forward(self, x):
        b = self.box(x)[0].abs() * 3 + 2
        h, w = int(b[0]), int(b[1])
        m = self.mask(x)[:1].reshape(1, 1, 2, 2)
        return F.interpolate(m, size=(h, w), mode="bilinear", align_corners=False).sum()


def test_replay_refuses_past_a_data_dependent_shape_and_rerun_works():
    # before: replay silently reused the recorded upsample size
    torch.manual_seed(3)
    model, x = DataDependent(), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x)
    reads = [op for op in trace.ops if op.meta.get("value_reads")]
    assert reads, "the capture records which op's values the forward read into Python"
    with pytest.raises(ReplayPreconditionError) as e:
        trace.fork().do(tl.module("box"), tl.scale(3.0))
    assert e.value.code == "replay_value_read_changed" and e.value.fields["read"] == "__int__"
    want = _hooked(model, "box", lambda o: o * 3.0, x)
    got = _quiet(trace.fork().do, tl.module("box"), tl.scale(3.0), model=model, inputs=x)
    assert torch.equal(got.output_ops[0].out, want)
    # an edit that leaves every read value as it was still replays (here: after the reads)
    fork = _quiet(trace.fork().do, tl.module("mask"), tl.scale(2.0))
    assert torch.allclose(fork.output_ops[0].out, _hooked(model, "mask", lambda o: o * 2.0, x))


# torch.compile inside the forward -------------------------------------------------------------

@pytest.fixture(scope="module")
def dynamo():
    dyn = pytest.importorskip("torch._dynamo")
    dyn.reset()
    yield dyn
    dyn.reset()


def test_a_compiled_dynamic_helper_is_captured_op_by_op(dynamo):
    # before: [forward_failed] InternalTorchDynamoError: unhashable type: 'slice' (dynamo traced the recorder)
    @torch.compile(dynamic=True, backend="eager")
    def helper(t):
        return torch.sin(t[:, :2]) * 2

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return helper(self.fc(x)) + helper(self.fc(x * 2))

    model, x = M(), torch.randn(3, 4)
    want = _quiet(model, x)
    for _ in range(2):  # a cached compiled helper is recorded the same way
        trace = _quiet(tl.trace, model, x)
        assert torch.equal(trace.output, want)
        assert [o.func_name for o in trace.ops if o.kind == "op"].count("sin") == 2
        assert trace.validate_forward_pass(), trace.validation_replay_status


def test_a_compiled_submodule_is_captured_op_by_op(dynamo):
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(4, 4)
            self.mid = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.GELU()), dynamic=True, backend="eager")

        def forward(self, x):
            return self.mid(self.pre(x))

    model = M()
    for n in (3, 5):  # two shapes: a dynamic recompile
        x = torch.randn(n, 4)
        want = _quiet(model, x)
        with pytest.warns(RuntimeWarning, match=r"\[capture_compiled_region_eager\] .*mid"):
            trace = tl.trace(model, x)
        assert trace.provenance.extra["compiled_regions_run_eager"] == ["mid"]
        assert torch.equal(trace.output, want)  # the eager backend: the same kernels
        assert [o.func_name for o in trace.ops if o.kind == "op"] == ["linear", "linear", "gelu"]
        assert trace.validate_forward_pass()


# torch.autograd.grad inside the forward ----------------------------------------------------------

class AutogradInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.energy, self.head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.energy(x).sum(), x)
        return self.head(-g)


def test_autograd_grad_in_the_forward_refuses_replay_and_validation_typed():
    # before: validate returned False (backward through a freed graph) and replay raised
    # replay_execution_failed from inside the op
    torch.manual_seed(0)
    model, x = AutogradInForward(), torch.randn(3, 4)
    trace = _quiet(tl.trace, model, x)
    with pytest.raises(ValidationError) as e:
        trace.validate_forward_pass()
    assert e.value.code == "validation_unavailable" and e.value.fields["reason"] == "autograd_grad"
    with pytest.raises(ReplayPreconditionError) as e:
        trace.fork().do(tl.module("energy.0"), tl.scale(2.0))
    assert e.value.code == "replay_op_unsupported"
    want = _hooked(model, "energy.0", lambda o: o * 2.0, x)  # the rerun engine works
    got = _quiet(trace.fork().do, tl.module("energy.0"), tl.scale(2.0), model=model, inputs=x)
    assert torch.equal(got.output_ops[0].out, want)
    fork = _quiet(trace.fork().do, tl.module("head"), tl.zero_ablate())  # an edit after the grad op replays
    assert torch.equal(fork.output_ops[0].out, torch.zeros(3, 4))


# minor: no-op conversions, .T, fork/root output -------------------------------------------------

class NoOpFloat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        z = y.float()  # a no-op: returns y itself
        return y + 1, z


def test_a_no_op_conversion_does_not_take_over_its_input():
    # before: `y + 1` read float_1_2, and fc's output was attributed to nothing the module ran
    trace = _quiet(tl.trace, NoOpFloat(), torch.randn(2, 4))
    add = next(o for o in trace.ops if o.label.startswith("add_"))
    assert add.parents == ("linear_1_1",)
    assert trace.modules["fc"].calls[0].output_labels == ["linear_1_1"]


def test_the_T_property_is_its_own_layer():
    # labels use PyPI torchlens's type token (`x.T` reads `t_...` there too); the property read
    # and the method call stay two layers with their own callable names
    class M(nn.Module):
        def forward(self, x):
            return x.T + x.t()

    trace = _quiet(tl.trace, M(), torch.randn(2, 3))
    ops = [o for o in trace.ops if o.kind == "op"]
    assert [(o.label, o.func_name) for o in ops[:2]] == [("t_1_1", "T"), ("t_2_2", "t")]


def test_a_root_trace_edited_in_place_has_no_live_output():
    torch.manual_seed(0)
    model, x = NoOpFloat(), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x)
    _quiet(trace.do, tl.module("fc"), tl.scale(2.0))
    with pytest.raises(PayloadUnavailableError) as e:
        trace.output
    assert e.value.fields["reason"] == "edited"
    with pytest.raises(PayloadUnavailableError):
        _quiet(trace.fork().do, tl.module("fc"), tl.scale(2.0)).output


# issue 13: buffer versions, non-finite warning, backward on inference-only -----------------------

class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("state", torch.zeros(4))
        self.register_buffer("pad", torch.zeros(2, 6))

    def forward(self, x):
        self.count.add_(1)
        self.state = self.state * 0.5 + x.mean(0)  # a reassignment
        self.count += 1
        self.pad[:, :4].copy_(x)  # a write through a view
        return self.fc(x) + self.count + self.state + self.pad[:, 1:5]


def test_every_recorded_buffer_write_is_its_own_version():
    torch.manual_seed(0)
    model, x = Buffers(), torch.randn(2, 4)
    trace = _quiet(tl.trace, model, x)
    count = [o.label.split("_")[0] for o in trace.buffers["count"].versions]
    assert count == ["buffer", "add", "add"]  # the source, add_(1), += 1
    state = trace.buffers["state"].versions
    assert [o.label.split("_")[0] for o in state] == ["buffer", "add"]
    assert torch.equal(state[-1].out, torch.zeros(4) * 0.5 + x.mean(0))
    pad = trace.buffers["pad"].versions
    assert [o.func_name for o in pad] == ["buffer", "as_strided_scatter"]
    assert torch.equal(pad[-1].out[:, :4], x) and torch.equal(pad[-1].out[:, 4:], torch.zeros(2, 2))
    assert torch.equal(model.pad, torch.zeros(2, 6)) and float(model.count) == 0.0  # pure observer


def test_on_nonfinite_warn_warns_once_per_capture_with_its_code():
    class M(nn.Module):
        def forward(self, x):
            return torch.log(x) * 2 + torch.sqrt(x)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace = tl.trace(M(), torch.tensor([-1.0, 2.0]), capture=CaptureOptions(on_nonfinite="warn"))
    mine = [w for w in seen if "NaN" in str(w.message) or "nonfinite" in str(w.message)]
    assert len(mine) == 1 and str(mine[0].message).startswith("[capture_nonfinite_detected]")
    assert len(trace.nonfinite_ops) == 4


def test_no_grad_implies_inference_only_only_when_the_graph_was_discarded():
    class Regrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            with torch.enable_grad():
                return self.fc(x)

    with torch.no_grad():
        plain = _quiet(tl.trace, nn.Linear(4, 4), torch.randn(2, 4))
        regrad = _quiet(tl.trace, Regrad(), torch.randn(2, 4))
        explicit = _quiet(tl.trace, Regrad(), torch.randn(2, 4), capture=CaptureOptions(inference_only=True))
    assert plain.options.inference_only is True
    assert regrad.options.inference_only is False  # it returned an autograd graph
    assert explicit.options.inference_only is True  # an explicit value is never changed


def test_backward_on_an_inference_only_capture_names_the_cause():
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    with torch.no_grad():
        trace = _quiet(tl.trace, model, x)
    with pytest.raises(InvalidArgumentError) as e:
        trace.backward(trace.output_ops[0].out.sum())
    assert e.value.code == "backward_inference_only" and "no_grad" in str(e.value)
