"""The one per-op replay engine (`torchlens.replay.engine`): validation and interventions
re-execute recorded ops through it; backends supply a `ReplayOps` (defaults in
`ReplayOpsBase`, served to backends as `torchlens.backends.sdk.ReplayOpsBase`)."""

from torchlens.replay.engine import ReplayFailure, ReplayOpsBase, Replayer, call_op, replay_ops_from, validate

__all__ = ["ReplayFailure", "ReplayOpsBase", "Replayer", "call_op", "replay_ops_from", "validate"]
