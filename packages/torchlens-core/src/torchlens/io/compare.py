"""trace_differences: does a loaded trace equal the one that was saved?

Both traces are written through the same typed encoding a save uses (every record field of
every kind, with payloads as codec bytes), then compared cell by cell and byte by byte. The
encoding tells tuples from lists, ints from bools and floats bit for bit, numbers shared
payloads in order of first use (so aliasing must match too), and writes a value with no
typed encoding as its type and repr, which is what a loaded `UnencodableValue` re-encodes to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.io.codec import backend_codec
from torchlens.io.schema import Encoder


def trace_differences(original: Any, loaded: Any, limit: int = 20) -> list[str]:
    """Where `loaded` differs from `original` (empty when every record and payload is equal)."""
    from torchlens.io.bundle import encode_tables

    diffs: list[str] = []
    codec = backend_codec(original._backend) if original._backend is not None else backend_codec(None)
    encs = [Encoder(codec), Encoder(codec)]
    tables = [encode_tables(t, e) for t, e in zip((original, loaded), encs)]
    for kind in tables[0]:
        a, b = tables[0][kind]["rows"], tables[1][kind]["rows"]
        if len(a) != len(b):
            diffs.append(f"{kind}: {len(a)} rows vs {len(b)}")
            continue
        cols = tables[0][kind]["columns"]
        for i, (ra, rb) in enumerate(zip(a, b)):
            for col, x, y in zip(cols, ra, rb):
                if x != y or repr(x) != repr(y):
                    diffs.append(f"{kind}[{i}].{col}: {repr(x)[:80]} != {repr(y)[:80]}")
    pa, pb = encs[0].payloads, encs[1].payloads
    if list(pa) != list(pb):
        diffs.append(f"payload keys differ: {len(pa)} vs {len(pb)}")
    for key in pa.keys() & pb.keys():
        x, y = pa[key], pb[key]
        if (x.dtype, x.shape, x.meta) != (y.dtype, y.shape, y.meta):
            diffs.append(f"payload {key}: {x.dtype}{x.shape} != {y.dtype}{y.shape}")
        elif x.array.tobytes() != y.array.tobytes():
            n = int(np.count_nonzero(np.frombuffer(x.array.tobytes(), np.uint8) != np.frombuffer(y.array.tobytes(), np.uint8)))
            diffs.append(f"payload {key}: {n} bytes differ")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs
