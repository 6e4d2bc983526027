"""The intervention layer's state on one trace (issue 14 §4 "Trace owns its state").

A trace keeps it in its typed slot `Trace._intervention` (None until first used); only this
layer creates or changes it. Records never import it: they reach it through the
`intervention_state` port and read the named fields below."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torchlens.intervention.recipe import Recipe

_EMPTY_DIGEST: str | None = None


def _empty_digest() -> str:
    global _EMPTY_DIGEST
    if _EMPTY_DIGEST is None:
        _EMPTY_DIGEST = Recipe().digest
    return _EMPTY_DIGEST


@dataclass
class InterventionState:
    """Recipe, evidence and last run of the interventions on one trace.

    - `recipe`: the staged rules (`trace.recipe`).
    - `audit`: one row per rule resolved by `do` / a rerun (`trace.intervention_audit`).
    - `warned`: the root-trace mutation warning was given.
    - `last_run`: what the last engine run reported (`trace.last_run`), or None.
    - `is_fork`: the trace is a fork or a rerun's result (no root-mutation warning).
    - `direct_writes` / `direct_write_dirty`: op labels written with `op.out = v` (evidence).
    - `steered_digest`: the digest of the recipe the recorded values reflect (a plain capture:
      the empty recipe's; None when unknown, e.g. a loaded trace whose values predate its recipe).
    - `live_armed`: identities of gradient rules with hooks on this trace's recorded backward graph
      (armed by the capture or rerun that built it, or by `trace.backward` for a rule staged with
      `engine="set_only"` on a backward-ready capture).
    - `armed_site_grads`: the edited gradients the hooks armed by `trace.backward` produced at
      their own sites during the last backward (label -> slot -> value); `trace.backward` writes
      them into those ops' `grads` (`take_armed_site_grads`), as a capture-armed edit's store sees them.
    """

    recipe: Recipe = field(default_factory=Recipe)
    audit: list[dict[str, Any]] = field(default_factory=list)
    warned: bool = False
    last_run: dict[str, Any] | None = None
    is_fork: bool = False
    direct_writes: list[str] = field(default_factory=list)
    direct_write_dirty: bool = False
    steered_digest: str | None = field(default_factory=_empty_digest)
    live_armed: tuple = ()
    armed_site_grads: dict[str, dict[int, Any]] = field(default_factory=dict)

    def forked(self, steered_digest: str | None) -> "InterventionState":
        """The state a fork starts with: the same recipe and evidence (lists copied), marked as a fork."""
        return InterventionState(recipe=self.recipe, audit=list(self.audit), warned=True, last_run=self.last_run,
                                 is_fork=True, direct_writes=list(self.direct_writes),
                                 direct_write_dirty=self.direct_write_dirty, steered_digest=steered_digest,
                                 live_armed=tuple(self.live_armed))

    def take_armed_site_grads(self) -> dict[str, dict[int, Any]]:
        """The edited site gradients of the last backward (emptied)."""
        out, self.armed_site_grads = self.armed_site_grads, {}
        return out

    @property
    def touched(self) -> bool:
        """Anything staged, audited or written directly (what `Trace.save` must keep)."""
        return bool(self.recipe.rules or self.audit or self.direct_writes)


class GradientArmingOps(Protocol):
    """A backend's `EditOps` that can arm gradient edits on a trace's kept backward graph after
    capture (for `engine="set_only"` rules applied by `trace.backward`).

    `arm_gradient_edits(trace, labels, apply)` registers, for every output slot of each op in
    `labels`, a backward hook that replaces the gradient `g` arriving at that slot with
    `apply(label, slot, g)`. It returns the labels it cannot arm (the op's saved value does not
    reach the live graph: not saved, detached, a loaded trace); when it returns any, it has
    registered nothing."""

    def arm_gradient_edits(self, trace: Any, labels: list[str], apply: Callable[[str, int, Any], Any]) -> list[str]: ...


class ReplayGradientOps(Protocol):
    """A backend's `EditOps` whose values carry no autograd graph (JAX) and that differentiates a
    differentiable replay (`InterventionOptions(differentiable=True)`) by re-evaluating it:
    `keep_replay_for_backward(trace, edits)` is called with the fork the replay returned and
    every edit its values reflect (op label -> edits in recipe order), so that
    `trace.backward(loss)` on that fork differentiates the edited forward."""

    def keep_replay_for_backward(self, trace: Any, edits: dict[str, list[Any]]) -> None: ...


def offers(ops: Any, protocol: type) -> bool:
    """True when `ops` (a backend's edit ops) has every member `protocol` declares: read from
    its class each time (an ABC `isinstance` would cache the answer per class)."""
    members = [m for m in vars(protocol) if not m.startswith("_")]
    return ops is not None and all(callable(getattr(type(ops), m, None)) for m in members)


def state_of(trace: Any) -> InterventionState:
    """The trace's intervention state, made on first use."""
    st = trace._intervention
    if st is None:
        st = trace._intervention = InterventionState()
    elif not isinstance(st, InterventionState):
        raise TypeError(f"trace._intervention holds {type(st).__name__}, not InterventionState")
    return st


__all__ = ["InterventionState", "GradientArmingOps", "ReplayGradientOps", "offers", "state_of"]
