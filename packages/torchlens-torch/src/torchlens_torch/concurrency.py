"""Captures and threads: one capture at a time per process, and a watch for other threads.

Why: `CaptureMode` (a `TorchFunctionMode`) is thread-local, but a capture also changes
process-global state for the length of the forward: torch's global module hooks, the MHA
fast-path flag, and the global random generator (read before each random op, rewound to the
caller's state afterwards); validation replays set the global generator too. Two captures
overlapping in time would restore each other's snapshots: the caller's RNG left advanced, the
fast path left off for the whole process, random ops recorded under a state another capture
had just rewound.

So every capture (and every validation replay) of the torch backend holds `CAPTURE_LOCK`, a
re-entrant process-wide lock. A second thread's capture waits for the running one, at most
`CAPTURE_LOCK_TIMEOUT_S` seconds, then refuses with `ReentrantTraceError`
(`capture_lock_timeout`) before touching anything. Waiting (rather than refusing at once)
keeps a multi-threaded server correct without retries; the bound turns a deadlock (a forward
that waits for a thread which itself tries to capture) into a typed error.

What no lock can stop is Python code running on other threads during the capture: a worker
thread the forward starts (its ops are invisible to the thread-local mode and come back as
constants) or an unrelated plain forward on another thread. `ThreadWatch` notices threads
started during the capture; the recorder notices the traced model's modules running on
another thread and draws from the global random stream it did not make (see
`Recorder.rng_check`). All three flag the trace and warn with a stable code instead of
returning a silently wrong trace.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from typing import Any, Iterator

from torchlens.backends.sdk import ReentrantTraceError

#: Held by the running capture or validation replay (re-entrant: a capture's own thread may
#: validate or capture again inside it).
CAPTURE_LOCK = threading.RLock()

#: How long a capture waits for another thread's capture before it refuses (seconds).
CAPTURE_LOCK_TIMEOUT_S: float = 120.0

_holder: dict[str, Any] = {"thread": None, "since": None}


@contextlib.contextmanager
def exclusive(what: str = "capture") -> Iterator[None]:
    """Hold the process-wide capture lock for the block, or refuse typed after the wait."""
    timeout = float(CAPTURE_LOCK_TIMEOUT_S)
    if not CAPTURE_LOCK.acquire(timeout=timeout):
        holder = _holder["thread"]
        since = _holder["since"]
        raise ReentrantTraceError(
            "capture_lock_timeout",
            f"another thread's torch capture held the process-wide capture lock for more than {timeout:g}s",
            remedy=("captures of the torch backend run one at a time per process; wait for the other capture, "
                    "raise torchlens_torch.concurrency.CAPTURE_LOCK_TIMEOUT_S, or capture in another process"),
            waited_s=timeout, what=what, holder_thread=holder,
            held_s=None if since is None else round(time.monotonic() - since, 3))
    outer = _holder["thread"] is None
    if outer:
        _holder["thread"] = threading.current_thread().name
        _holder["since"] = time.monotonic()
    try:
        yield
    finally:
        if outer:
            _holder["thread"] = None
            _holder["since"] = None
        CAPTURE_LOCK.release()


class ThreadWatch:
    """Notes every thread started while it is active that runs Python code.

    `threading.setprofile` installs a profile hook in each thread started by the `threading`
    module from now on; the hook fires on the thread's first Python call, records the thread
    and uninstalls itself from that thread at once (handing back any hook the caller had set),
    so the cost is one call per new thread. Threads that already existed (a reused thread
    pool) are not seen here; the recorder's module hooks see those when they run the traced
    model's modules.
    """

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.active = False
        self.owner = threading.get_ident()
        self.prev: Any = None

    def __enter__(self) -> "ThreadWatch":
        self.prev = threading.getprofile()
        self.active = True
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.active = False
        threading.setprofile(self.prev)
        return False

    def _hook(self, frame: Any, event: str, arg: Any) -> Any:
        prev = self.prev
        sys.setprofile(prev)  # uninstall in this thread first: the hook runs once per thread
        if self.active and threading.get_ident() != self.owner:
            self.seen.append(threading.current_thread().name)
        if prev is not None:
            return prev(frame, event, arg)
        return None


class GcPause:
    """Python's cyclic garbage collector paused for a block, then set back as it was.

    Why: a capture allocates several small container objects per op (events, tuples, meta
    dicts, records), and the collector's generation thresholds count allocations, so a
    long forward triggers full collections that walk every live object, the model's and
    the framework's included: a fifth to a third of the capture's cost on models with many
    small ops (issue 26). Reference counting still frees everything acyclic at once; what a
    cycle made during the forward holds is collected at the first collection after it.

    Re-entrant (a composite re-enters the capture's mode): only the outermost block pauses
    and restores. A forward that switches the collector itself gets the caller's setting back.
    """

    __slots__ = ("depth", "was_enabled")

    def __init__(self) -> None:
        self.depth = 0
        self.was_enabled = False

    def __enter__(self) -> "GcPause":
        if self.depth == 0:
            self.was_enabled = gc.isenabled()
            if self.was_enabled:
                gc.disable()
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.depth -= 1
        if self.depth == 0 and self.was_enabled:
            gc.enable()
        return False
