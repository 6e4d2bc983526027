"""`tl.backends.jax.GradOptions`: the request for derived gradients (imports no jax).

One dataclass shared by every preview backend, defined in the SDK. The preview backend declares
`intermediate_derived_grads=False`, so passing `grad_options=GradOptions(...)` to `tl.trace`
refuses with `intermediate_derived_grads_unsupported` before anything runs. The dataclass
exists so code written against the spec's namespace imports and type-checks today.
"""

from __future__ import annotations

from torchlens.backends.sdk import GradOptions

__all__ = ["GradOptions"]
