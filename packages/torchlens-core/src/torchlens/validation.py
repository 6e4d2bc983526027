"""`tl.validation`: checks of saved artifacts that need no framework, and the lower-level
entries of `tl.validate` for one scope each (`validate_forward_pass`, `validate_backward_pass`)."""

from __future__ import annotations

from typing import Any


def validate_tlspec(path: Any) -> dict[str, Any]:
    """Check a saved directory (a trace `.tlspec`, an intervention spec or a recipe) with
    every check `tl.load` makes: path rules, manifest schema and version, every file's size
    and sha256, every record cell against its schema, blob headers against the payload
    records, each payload and literal through the codec the artifact names. A trace's
    payloads are decoded one at a time and dropped, not kept. Returns the manifest; raises
    the typed error `tl.load` would raise (the code of the first failure), so it refuses
    exactly what `tl.load` refuses."""
    from torchlens.io.artifact import validate_artifact

    return validate_artifact(path)


def validate_forward_pass(model: Any, *args: Any, input_kwargs: dict[str, Any] | None = None,
                          output_device: str = "same", save_budget: Any = "auto", trace_observer: Any = None,
                          num_threads: int | None = None, backend: str | None = None) -> bool:
    """`tl.validate(model, *args, scope="forward", ...)`: capture with everything saved, replay
    every op from its saved inputs under its recorded RNG state and compare, perturb each
    input of each op. `output_device` and `save_budget` set the capture's save options."""
    from torchlens.check import validate

    return validate(model, *args, scope="forward", input_kwargs=input_kwargs, output_device=output_device,
                    save_budget=save_budget, trace_observer=trace_observer, num_threads=num_threads, backend=backend)


def validate_backward_pass(model: Any, *args: Any, input_kwargs: dict[str, Any] | None = None,
                           trace_observer: Any = None, num_threads: int | None = None,
                           backend: str | None = None) -> bool:
    """`tl.validate(model, *args, scope="backward", ...)`: the gradients a traced forward and
    `trace.backward` give (parameters, inputs, every module output) against a plain backward
    of the same seeded loss."""
    from torchlens.check import validate

    return validate(model, *args, scope="backward", input_kwargs=input_kwargs, trace_observer=trace_observer,
                    num_threads=num_threads, backend=backend)


__all__ = ["validate_tlspec", "validate_forward_pass", "validate_backward_pass"]
