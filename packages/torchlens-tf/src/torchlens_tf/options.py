"""`tl.backends.tf.GradOptions`: the request for derived gradients (imports no tensorflow).

The preview backend declares `intermediate_derived_grads=False`, so passing
`grad_options=GradOptions(...)` to `tl.trace` refuses with
`intermediate_derived_grads_unsupported` before anything runs; gradients of a trace come from
`trace.backward(loss)` on a capture made with `CaptureOptions(backward_ready=True,
save_grads=True)`. The dataclass exists so code written against the spec's namespace imports
and type-checks today. (Twin of `torchlens_jax.options.GradOptions`; an SDK `GradOptions`
would serve every backend: see the notes.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradOptions:
    """Which derived gradients a capture should compute.

    - `wrt`: what to differentiate with respect to: `"inputs"`, `"params"` or `"both"`.
    - `loss`: optional callable mapping the model output to a scalar (default: sum).
    - `intermediates`: also derive gradients at every recorded op output.
    """

    wrt: str = "inputs"
    loss: object = None
    intermediates: bool = True

    def __post_init__(self) -> None:
        if self.wrt not in ("inputs", "params", "both"):
            from torchlens.backends.sdk import InvalidArgumentError

            raise InvalidArgumentError("invalid_argument", f"GradOptions(wrt={self.wrt!r}) is not 'inputs', 'params' or 'both'",
                                       remedy="wrt='inputs'", field="wrt")
