"""What the capture must get right: in-place writes, views, multi-output ops, literal
producers, constants, module-held tensors, no_grad, random ops, control flow, repeated
module calls, loops, nested containers and composites."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchlens as tl
from torchlens_torch.testing import mha_fastpath_disabled


class Inplace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        z = F.relu(y - 3, inplace=True)
        z[0] = 1.0
        return z


def test_inplace_ops_keep_the_value_before_the_write():
    x = torch.arange(6.0).reshape(2, 3)
    t = tl.trace(Inplace(), x)
    mul, add_, sub, relu_, setitem = (t[tl.func(n)].first() for n in ("mul", "add_", "sub", "relu", "__setitem__"))
    assert torch.equal(mul.out, x * 2)
    assert torch.equal(add_.out, x * 2 + 1)
    assert add_.is_inplace and relu_.is_inplace and setitem.is_inplace
    assert add_.parents == (mul.label,)
    assert torch.equal(relu_.out, F.relu(x * 2 + 1 - 3))
    assert setitem.parents == (relu_.label,)
    assert torch.equal(setitem.out, t.output)
    assert setitem.out[0].eq(1).all()
    assert not relu_.out[0].eq(1).all()


def test_inplace_write_through_a_view_keeps_earlier_payloads():
    class M(nn.Module):
        def forward(self, x):
            y = x + 1
            v = y[0]
            v.mul_(10)
            return y * 1

    t = tl.trace(M(), torch.ones(2, 2))
    add = t[tl.func("add")].first()
    assert torch.equal(add.out, torch.full((2, 2), 2.0))
    assert torch.equal(t.output, torch.tensor([[20.0, 20.0], [2.0, 2.0]]))


def test_views_are_ops_with_parents():
    class M(nn.Module):
        def forward(self, x):
            return x.view(2, 3).transpose(0, 1)[1:].T

    x = torch.arange(6.0)
    t = tl.trace(M(), x)
    names = [o.func_name for o in t.ops if o.kind == "op"]
    assert names == ["view", "transpose", "__getitem__", "T"]
    assert torch.equal(t.output, x.view(2, 3).transpose(0, 1)[1:].T)
    assert [len(o.parents) for o in t.ops if o.kind == "op"] == [1, 1, 1, 1]


def test_multi_output_ops_are_one_op_with_slots():
    class M(nn.Module):
        def forward(self, x):
            values, idx = torch.max(x, dim=1)
            a, b = x.split(1, dim=0)
            return values + a.squeeze(0), idx, b

    x = torch.randn(2, 2)
    t = tl.trace(M(), x)
    mx = t[tl.func("max")].first()
    assert mx.multi_output and len(mx.outs) == 2
    assert torch.equal(mx.outs[0], x.max(1).values) and torch.equal(mx.outs[1], x.max(1).indices)
    split = t[tl.func("split")].first()
    assert split.multi_output and len(split.shapes) == 2
    add = t[tl.func("add")].first()
    assert set(add.parents) == {mx.label, t[tl.func("squeeze")].first().label}
    assert [o.parents for o in t.output_ops] == [(add.label,), (mx.label,), (split.label,)]


def test_lstm_is_one_multi_output_op():
    lstm = nn.LSTM(3, 4, batch_first=True)
    t = tl.trace(lstm, torch.randn(1, 5, 3))
    ops = [o for o in t.ops if o.kind == "op"]
    assert [o.func_name for o in ops] == ["zeros", "zeros", "lstm"]  # h0, c0, then one call
    ops = ops[2:]
    assert ops[0].multi_output and len(ops[0].outs) == 3
    assert t.modules["self"].calls[0].output_labels == [ops[0].label]
    assert set(ops[0].params) == {name for name, _ in lstm.named_parameters()}


def test_literal_producers_have_no_parents():
    class M(nn.Module):
        def forward(self, x):
            return x + torch.zeros(3) + torch.arange(3)

    t = tl.trace(M(), torch.ones(3))
    for name in ("zeros", "arange"):
        op = t[tl.func(name)].first()
        assert op.kind == "op" and op.parents == () and op.saved and op.is_source


CONST = torch.tensor([1.0, 2.0, 3.0])


def test_closure_tensors_are_constant_ops():
    class M(nn.Module):
        def forward(self, x):
            return x * CONST

    t = tl.trace(M(), torch.ones(3))
    const = [o for o in t.ops if o.kind == "constant"]
    assert len(const) == 1 and const[0].func_name == "constant" and const[0].parents == ()
    assert torch.equal(const[0].out, CONST)
    assert const[0].label in t[tl.func("mul")].first().parents


def test_module_held_tensors_and_buffers_are_buffers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((3,), 2.0))
            self.plain = torch.ones(3)
            self.cache = {"cpu": torch.full((3,), 5.0)}
            self.items = [torch.full((3,), 7.0)]

        def forward(self, x):
            return x * self.scale + self.plain + self.cache["cpu"] + self.items[0]

    t = tl.trace(M(), torch.ones(3))
    assert set(t.buffers.labels) == {"scale", "plain", "cache['cpu']", "items.0"}
    buffer_ops = [o for o in t.ops if o.kind == "buffer"]
    assert sorted(o.path for o in buffer_ops) == sorted(t.buffers.labels)
    assert not [o for o in t.ops if o.kind == "constant"]
    assert t.buffers["scale"].versions[0].label.startswith("buffer_")


def test_no_grad_regions_are_recorded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                y = self.fc(x)
            return y.relu()

    t = tl.trace(M(), torch.ones(1, 3))
    assert [o.func_name for o in t.ops if o.kind == "op"] == ["linear", "relu"]


def test_random_ops_are_captured_once_with_rng_state(restore_rng):
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True) + torch.randn(x.shape)

    x = torch.ones(4, 4)
    torch.manual_seed(3)
    t = tl.trace(M(), x)
    torch.manual_seed(3)
    ref = M()(x)
    assert torch.equal(t.output, ref)
    drop, randn = t[tl.func("dropout")].first(), t[tl.func("randn")].first()
    assert isinstance(drop.meta["rng_state"], torch.Tensor)
    torch.set_rng_state(randn.meta["rng_state"])
    assert torch.equal(torch.randn(4, 4), randn.out)
    assert isinstance(t.provenance.extra["rng_state"], torch.Tensor)


def test_seed_option_makes_random_captures_repeatable():
    m = nn.Dropout(0.5).train()
    x = torch.ones(8, 8)
    a = tl.trace(m, x, capture=tl.CaptureOptions(seed=7))
    b = tl.trace(m, x, capture=tl.CaptureOptions(seed=7))
    assert torch.equal(a.output, b.output)


def test_only_the_taken_branch_is_recorded():
    class M(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x.exp()
            return x.sin()

    pos = tl.trace(M(), torch.ones(2))
    neg = tl.trace(M(), -torch.ones(2))
    assert pos[tl.func("exp")] and not pos[tl.func("sin")]
    assert neg[tl.func("sin")] and not neg[tl.func("exp")]


def test_a_module_called_twice_has_two_calls_and_two_passes():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.fc(x))

    t = tl.trace(M(), torch.ones(1, 3))
    assert t.modules["fc"].num_calls == 2
    assert [c.label for c in t.modules["fc"].calls] == ["fc:1", "fc:2"]
    layer = t.layers[t[tl.func("linear")].first().layer_label]
    assert layer.num_passes == 2
    assert torch.equal(t["fc:2"].out, t.output)


def test_a_loop_reusing_one_layer_makes_passes_and_written_out_copies_make_layers():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            for _ in range(3):
                x = torch.tanh(self.fc(x))
            x = torch.tanh(x)
            x = torch.tanh(x)
            return x

    t = tl.trace(Loop(), torch.ones(1, 3))
    tanh_layers = [l for l in t.layers if l.func_name == "tanh"]
    assert [l.num_passes for l in tanh_layers] == [3, 1, 1]
    linear = [l for l in t.layers if l.func_name == "linear"]
    assert len(linear) == 1 and linear[0].num_passes == 3
    assert [o.label for o in linear[0].ops] == [f"{linear[0].label}:{i}" for i in (1, 2, 3)]


def test_nested_container_inputs_and_outputs():
    class M(nn.Module):
        def forward(self, pair, mapping, mask=None):
            a, b = pair
            out = a + b * mapping["w"]
            return {"sum": out, "parts": (a, out * mask)}

    pair = (torch.ones(2), torch.full((2,), 2.0))
    mapping = {"w": torch.full((2,), 3.0)}
    mask = torch.tensor([1.0, 0.0])
    t = tl.trace(M(), pair, mapping, input_kwargs={"mask": mask})
    # core's one input-path convention (issue 14 §3): positions, not the forward's parameter names
    assert [o.path for o in t.input_ops] == ["args[0][0]", "args[0][1]", "args[1]['w']", "kwargs['mask']"]
    assert [o.path for o in t.output_ops] == ["output['sum']", "output['parts'][0]", "output['parts'][1]"]
    assert isinstance(t.output, dict) and torch.equal(t.output["sum"], torch.full((2,), 7.0))


def test_trace_output_is_exactly_the_returned_object(build_zoo):
    model, args, kwargs = build_zoo("gpt2_eager")
    t = tl.trace(model, *args, input_kwargs=kwargs)
    assert type(t.output).__name__ == "CausalLMOutputWithCrossAttentions"
    assert torch.equal(t.output.logits, model(*args, **kwargs).logits)


def test_multihead_attention_inner_ops_are_recorded():
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 4, 8)
    t = tl.trace(mha, x, x, x)
    inner = [o for o in t.ops if o.meta.get("composite", "").startswith("multi_head_attention_forward#")]
    names = {o.func_name for o in inner}
    assert {"linear", "softmax"} <= names and names & {"bmm", "baddbmm"}
    assert t.params["in_proj_weight"].num_calls >= 1 and t.params["out_proj.weight"].num_calls == 1
    with mha_fastpath_disabled():
        out, weights = mha(x, x, x)
    assert torch.equal(t.output[0], out) and torch.equal(t.output[1], weights)
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the capture


def test_transformer_encoder_fast_path_is_off_during_capture(build_zoo):
    model, args, kwargs = build_zoo("transformer_encoder")
    t = tl.trace(model, *args)
    names = {o.func_name for o in t.ops if o.kind == "op"}
    assert "_transformer_encoder_layer_fwd" not in names and "linear" in names and "layer_norm" in names


def test_parameters_are_not_ops_but_listed_on_their_readers():
    fc = nn.Linear(3, 2)
    t = tl.trace(fc, torch.ones(1, 3))
    op = t[tl.func("linear")].first()
    assert set(op.params) == {"weight", "bias"}
    assert t.params["weight"].num_calls == 1
    assert not [o for o in t.ops if o.kind in ("buffer", "constant")]


def test_module_stack_and_root_calls():
    fc = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    t = tl.trace(fc, torch.ones(1, 3))
    relu = t[tl.func("relu")].first()
    assert relu.module_calls == ("self:1", "1:1")
    assert t.modules["self"].num_calls == 1
    assert t.input_ops[0].modules == () and t.output_ops[0].modules == ()


def test_bound_method_root_uses_the_owner():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

        def twice(self, x):
            return self(self(x))

    m = M()
    t = tl.trace(m.twice, torch.ones(1, 2))
    assert t.modules["self"].num_calls == 2
    assert t.provenance.root_entry_point == "bound_method:test_bound_method_root_uses_the_owner.<locals>.M.twice"
    assert t.modules["fc"].num_calls == 2


def test_generate_bound_method_is_accepted(build_zoo):
    model, args, _ = build_zoo("gpt2_sdpa")
    t = tl.trace(model.generate, *args, input_kwargs={"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0})
    assert t.provenance.root_entry_point == "bound_method:GPT2LMHeadModel.generate"
    assert t.modules["self"].num_calls == 2 and t.modules["transformer.h.0"].num_calls == 2
    assert t.output.shape == (1, args[0].shape[1] + 2)


def test_costs_are_recorded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.conv = nn.Conv2d(3, 5, 3)

        def forward(self, x, img):
            q = torch.randn(1, 2, 4, 8)
            a = F.scaled_dot_product_attention(q, q, q)
            return self.fc(x) @ torch.ones(4, 6), self.conv(img), a

    t = tl.trace(M(), torch.ones(2, 8), torch.ones(1, 3, 6, 6))
    lin = t[tl.func("linear")].first()
    assert lin.macs == 2 * 4 * 8 and lin.flops == 2 * 2 * 4 * 8 + 2 * 4
    mm = t[tl.func("matmul")].first()
    assert mm.macs == 2 * 6 * 4
    conv = t[tl.func("conv2d")].first()
    assert conv.macs == 5 * 4 * 4 * 3 * 3 * 3
    sdpa = t[tl.func("scaled_dot_product_attention")].first()
    assert sdpa.macs == 2 * (2 * 4 * 4 * 8)
    assert t.cost.total_macs >= lin.macs + mm.macs + conv.macs + sdpa.macs
    assert all(o.duration is not None for o in t.ops if o.kind == "op")


def test_out_argument_writes_keep_earlier_payloads():
    class M(nn.Module):
        def forward(self, x):
            buf = x * 1
            torch.add(x, 5, out=buf)
            return buf

    t = tl.trace(M(), torch.ones(2))
    mul = t[tl.func("mul")].first()
    add = t[tl.func("add")].first()
    assert torch.equal(mul.out, torch.ones(2)) and torch.equal(add.out, torch.full((2,), 6.0))
    assert add.is_inplace and mul.label in add.parents


def test_functional_with_inplace_false_is_not_inplace():
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(F.relu(x), 0.5, training=False)

    t = tl.trace(M(), torch.ones(2))
    assert not any(o.is_inplace for o in t.ops)


def _halve(x, n):
    x = torch.relu(x) * 0.5
    return _halve(x, n - 1) if n > 1 else x


def _scale(x):
    return x * 3


def test_recursion_makes_passes_and_a_helper_called_from_two_places_makes_two_layers():
    class M(nn.Module):
        def forward(self, x):
            y = _halve(x, 3)
            return _scale(y) + _scale(x)

    t = tl.trace(M(), torch.ones(2))
    relu_layers = [l for l in t.layers if l.func_name == "relu"]
    assert [l.num_passes for l in relu_layers] == [3]
    mul_layers = [l for l in t.layers if l.func_name == "mul"]
    assert sorted(l.num_passes for l in mul_layers) == [1, 1, 3]
