"""CPR and CMD against a hand trapezoid."""

from __future__ import annotations

import math
import random

import pytest

import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError
from torchlens_mechinterp.faithfulness import MIB_FRACTIONS

SPEC_CURVE = [0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.05, 1.0, 0.98, 1.0]


def hand_trapezoid(xs, ys):
    total = 0.0
    for i in range(len(xs) - 1):
        total += (xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2
    return total


def test_spec_curve_equals_a_hand_trapezoid():
    xs = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
    assert list(MIB_FRACTIONS) == xs
    cpr = mi.circuit_performance_ratio(SPEC_CURVE)
    cmd = mi.circuit_model_difference(SPEC_CURVE)
    assert cpr == pytest.approx(hand_trapezoid(xs, SPEC_CURVE), abs=1e-15)
    assert cmd == pytest.approx(hand_trapezoid(xs, [abs(1 - y) for y in SPEC_CURVE]), abs=1e-15)
    assert 0 < cmd < cpr < 1
    logx = [math.log(x) for x in xs]
    assert mi.circuit_performance_ratio(SPEC_CURVE, log_scale=True) == pytest.approx(
        hand_trapezoid(logx, SPEC_CURVE), abs=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_random_curves_mappings_and_fractions(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    xs = sorted(rng.sample(range(1, 1000), n))
    xs = [x / 1000 for x in xs]
    ys = [rng.uniform(-0.5, 1.5) for _ in xs]
    assert mi.circuit_performance_ratio(ys, fractions=xs) == pytest.approx(hand_trapezoid(xs, ys), abs=1e-14)
    mapping = dict(zip(xs, ys))
    items = list(mapping.items())
    rng.shuffle(items)
    assert mi.circuit_model_difference(dict(items)) == pytest.approx(
        hand_trapezoid(xs, [abs(1 - y) for y in ys]), abs=1e-14)


@pytest.mark.parametrize("args,kwargs", [
    ([0.1, 0.2], {}),  # 2 values for 10 default fractions
    ([0.1, float("nan")], {"fractions": [0.5, 1.0]}),
    ([0.1, 0.2], {"fractions": [1.0, 0.5]}),
    ([0.1, 0.2], {"fractions": [0.0, 0.5]}),
    ([0.1], {"fractions": [0.5]}),
    ({0.5: 0.1, 1.0: 0.2}, {"fractions": [0.5, 1.0]}),
    (3.0, {}),
    (["a", "b"], {"fractions": [0.5, 1.0]}),
])
def test_malformed_curves_refuse(args, kwargs):
    for f in (mi.circuit_performance_ratio, mi.circuit_model_difference):
        with pytest.raises(MechInterpError) as exc:
            f(args, **kwargs)
        assert exc.value.code == "mi_faithfulness_curve_invalid"
