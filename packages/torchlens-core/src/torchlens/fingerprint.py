"""`tl.fingerprint`: the provisional structural-hash namespace (spec glossary l. 922).

The hash is `trace.provenance.fingerprint`: sha256 over every op of a capture, in execution
order, of its callable, kind, parent positions, output shapes and dtypes and the class of
the module it ran in. Module addresses, labels, weights and input values do not enter it, so
it pins a model's architecture on inputs of given shapes (docs/reference/trace-facts.md).
"""

from __future__ import annotations

import re
from typing import Any

from torchlens.errors import FingerprintMismatchError, InvalidArgumentError

_HEX = re.compile(r"[0-9a-f]{64}")


def of(model_or_trace: Any, *args: Any, input_kwargs: dict[str, Any] | None = None, backend: str | None = None) -> str:
    """The structural hash of a Trace, or of `model` captured (payloads not kept) on `args`."""
    from torchlens.records.identity import structural_fingerprint
    from torchlens.records.trace import Trace

    if isinstance(model_or_trace, Trace):
        if args or input_kwargs:
            raise InvalidArgumentError("invalid_argument", "tl.fingerprint.of(trace) takes no inputs",
                                       remedy="tl.fingerprint.of(trace), or tl.fingerprint.of(model, x)")
        return model_or_trace.provenance.fingerprint or structural_fingerprint(model_or_trace)
    from torchlens.capture import trace as _trace

    return _trace(model_or_trace, *args, save="none", input_kwargs=input_kwargs, backend=backend).provenance.fingerprint


def assert_unchanged(model: Any, pinned: Any, *args: Any, input_kwargs: dict[str, Any] | None = None,
                     backend: str | None = None) -> str:
    """Capture `model` on `args` (payloads not kept) and assert its structural hash equals
    `pinned` (a 64-hex string from `trace.provenance.fingerprint`, or a Trace). Returns the
    hash; raises `FingerprintMismatchError` (`fingerprint_changed`) when it differs."""
    from torchlens.records.trace import Trace

    expected = of(pinned) if isinstance(pinned, Trace) else pinned
    if not isinstance(expected, str) or not _HEX.fullmatch(expected):
        raise InvalidArgumentError("invalid_argument", f"pinned= takes a 64-hex fingerprint or a Trace, not {expected!r:.80}",
                                   remedy="pin trace.provenance.fingerprint (a str) or pass the Trace itself")
    actual = of(model, *args, input_kwargs=input_kwargs, backend=backend)
    if actual != expected:
        raise FingerprintMismatchError(
            "fingerprint_changed", f"the model's structural hash is {actual[:16]}..., the pinned one {expected[:16]}...",
            remedy="compare tl.trace(model, x).graph.edges (or summary()) with the pinned capture's; pin the new hash "
            "if the change is intended", expected=expected, actual=actual)
    return actual


__all__ = ["of", "assert_unchanged"]
