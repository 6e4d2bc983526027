"""Persistence acceptance on the whole torch zoo: every record field and every payload
survive save/load bit for bit, and the loaded trace validates."""

import warnings

import pytest

import torchlens as tl
from torchlens_torch import zoo


@pytest.mark.parametrize("name", zoo.names(available_only=True))
def test_zoo_model_round_trips_and_validates_after_load(name, tmp_path):
    warnings.simplefilter("ignore")
    model, args, kwargs = zoo.build(name)
    trace = tl.trace(model, *args, input_kwargs=kwargs)
    trace.save(tmp_path / f"{name}.tlspec")
    loaded = tl.load(tmp_path / f"{name}.tlspec")
    assert tl.io.trace_differences(trace, loaded) == []
    assert loaded.validate_forward_pass(), loaded.validation_replay_status.detail
