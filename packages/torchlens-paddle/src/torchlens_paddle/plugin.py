"""The `torchlens` entry point of this distribution. Light on purpose: no paddle import.

`torchlens_backends()` returns the PaddlePaddle `BackendSpec`; its `protocol` and `zoo`
factories import paddle (through `load_paddle`) only when a capture or the conformance suite
needs them.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torchlens
from torchlens.backends.sdk import BackendSpec, BackendUnsupportedError, FrameworkRequirement

#: Tested on paddlepaddle 3.3.1 (the CPU wheel) only: the preview range is the 3.3 series.
FRAMEWORK = FrameworkRequirement(
    distributions=("paddlepaddle", "paddlepaddle-gpu"),
    minimum="3.3.0",
    below="3.4",
    tested_through="3.3.1",
    pinned="3.3.1",
    extra="paddle",
)

#: The module holding paddle's native core: once it is loaded, paddle is safe to use.
_NATIVE = "paddle.base.libpaddle"


def load_paddle() -> Any:
    """Import paddle the way the backend needs it.

    - paddlepaddle 3.3's native core crashes the process (SIGSEGV) when it is loaded after
      tensorflow's: with tensorflow imported and paddle's core not yet loaded, this refuses
      typed (`runtime_conflict`) instead of crashing.
    - paddle warns at import that ccache is missing (a build-tool notice of no use to a user):
      that warning is filtered here, nothing else.
    """
    if _NATIVE not in sys.modules and "tensorflow" in sys.modules:
        raise BackendUnsupportedError(
            "runtime_conflict", "paddle's native core cannot be loaded after tensorflow's in one process "
            "(paddlepaddle 3.3 crashes the interpreter)",
            remedy="import paddle before tensorflow (or run the paddle trace in a process without tensorflow)",
            backend="paddle", loaded="tensorflow")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*ccache")
        import paddle
    return paddle


def _protocol() -> Any:
    load_paddle()
    from torchlens_paddle.backend import PaddleBackend

    return PaddleBackend()


def _zoo() -> Any:
    load_paddle()
    from torchlens_paddle.zoo import zoo

    return zoo()


@torchlens.hookimpl
def torchlens_backends() -> list[BackendSpec]:
    return [BackendSpec(
        name="paddle",
        maturity="preview",
        framework=FRAMEWORK,
        protocol=_protocol,
        modules=("paddle",),
        zoo=_zoo,
        namespace="torchlens_paddle",
        description="PaddlePaddle (dygraph): wraps every bound paddle._C_ops kernel function and the paddle.Tensor "
                    "operators during capture; paddle.nn.Layer scopes from forward pre/post hooks",
        package="torchlens-paddle",
    )]
