"""The framework-neutral records of distributed capture: `ArmingRecord`, `GroupIdentity`,
the `collective_boundary_v1` payload a collective boundary op carries, and the merge
vocabularies (`MergeAlignment`, `MergeValueStatus`).

A collective boundary op is an ordinary captured op whose `op.meta["collective"]` holds a
`collective_boundary_v1` dict (saved and loaded with the op's meta):

- `schema`: "collective_boundary_v1".
- `kind`: the collective ("all_reduce", "all_gather", "all_gather_into_tensor",
  "reduce_scatter", "reduce_scatter_tensor", "broadcast", "send", "recv", "isend", "irecv").
- `correlation_key`: `{"group_uid": [membership digest, lifetime ordinal], "seq": n, "channel": c}`.
  For collectives `seq` counts this group's collectives on this rank (every member calls them
  in the same order) and `channel` is "collective"; point-to-point messages count per ordered
  pair, `channel` "p2p:<src>-><dst>".
- `rank`, `group_rank`, `world_size`: the capturing process's global rank, its rank in the
  group and the group's size.
- `group`: the `GroupIdentity` as a dict.
- `geometry`: role-indexed: `role` ("contributor_receiver", "sender", "receiver", "root"),
  `contributed` and `received` (lists of `{"shape", "dtype"}`), `peer` (p2p), `root`
  (broadcast), `reduce_op` (reductions).
- `proof`: the fields that prove a match: `contributed_digest` / `received_digest` (sha256 of
  the raw bytes, one per tensor, in order), the same shapes and dtypes, and `reduce_op`.
- `notes`: event notes ("async: recorded at wait()", ...).
- `lifetime`: `{"ordinal_source": ..., "group_seq_at_first_use": ...}`.
- `arming`: the `ArmingRecord` as a dict; `run_id`: the run the rank belonged to.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from torchlens.errors import ArtifactError

BOUNDARY_SCHEMA = "collective_boundary_v1"

#: Collective kinds a boundary records (the capturing backend's names).
KINDS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
         "send", "recv", "isend", "irecv")

#: How arming happened (`ArmingRecord.source`).
ARMING_SOURCES = ("explicit", "lazy")

#: `Trace.provenance.distributed_scope` values (None for an ordinary capture).
DISTRIBUTED_SCOPES = ("rank_local_shard",)


class MergeAlignment:
    """Frozen vocabulary: how one correlation key aligned across the given ranks."""

    ALIGNED = "aligned"                    # every member rank has it, kinds and geometry agree
    MISSING_PEER = "missing_peer"          # a member rank's trace lacks it (or was not given)
    KIND_MISMATCH = "kind_mismatch"        # members ran different collectives under one key
    GEOMETRY_MISMATCH = "geometry_mismatch"  # reduce op, shapes or dtypes disagree
    RUN_MISMATCH = "run_mismatch"          # the members' run ids differ
    VALUES = frozenset({ALIGNED, MISSING_PEER, KIND_MISMATCH, GEOMETRY_MISMATCH, RUN_MISMATCH})


class MergeValueStatus:
    """Frozen vocabulary: what the recorded digests prove about one aligned collective."""

    PROVEN = "proven"              # the digests show the data moved as the kind says
    CONTRADICTED = "contradicted"  # the digests disagree (a receiver got other bytes)
    UNPROVEN = "unproven"          # no digest to compare (payloads not saved, or not comparable bitwise)
    VALUES = frozenset({PROVEN, CONTRADICTED, UNPROVEN})


@dataclass(frozen=True)
class ArmingRecord:
    """What `tl.distributed.arm()` established, stamped on every boundary record."""

    install_epoch: int          # this process's arming count: 1 for the first arm(), +1 per re-arm
    recognizer_snapshot: str    # digest of the wrapped collective names and the framework version
    source: str                 # "explicit" (arm()) or "lazy" (at capture entry)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "ArmingRecord":
        _need(isinstance(d, dict) and set(d) >= {"install_epoch", "recognizer_snapshot", "source"}
              and d["source"] in ARMING_SOURCES, "arming record")
        return cls(int(d["install_epoch"]), str(d["recognizer_snapshot"]), str(d["source"]))


def membership_digest(global_ranks: Any, backend: str) -> str:
    """sha256 over the sorted member ranks and the backend name (hex, 16 chars)."""
    text = "ranks:" + ",".join(str(int(r)) for r in sorted(global_ranks)) + "|backend:" + str(backend)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GroupIdentity:
    """The resolved lifetime identity of one process group on this rank."""

    membership_digest: str
    lifetime_ordinal: int       # which lifetime of that membership this group is (0 = the first)
    ordinal_source: str         # where the ordinal came from ("creation_order": counted per membership at arming)
    global_ranks: tuple[int, ...]
    backend: str

    @property
    def group_uid(self) -> tuple[str, int]:
        """The exactly-two-field correlation group identity."""
        return (self.membership_digest, self.lifetime_ordinal)

    @classmethod
    def of(cls, global_ranks: Any, backend: str, lifetime_ordinal: int = 0,
           ordinal_source: str = "creation_order") -> "GroupIdentity":
        ranks = tuple(int(r) for r in global_ranks)
        return cls(membership_digest(ranks, backend), int(lifetime_ordinal), ordinal_source, ranks, str(backend))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["global_ranks"] = list(self.global_ranks)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "GroupIdentity":
        _need(isinstance(d, dict) and set(d) >= {"membership_digest", "lifetime_ordinal", "ordinal_source",
                                                  "global_ranks", "backend"}, "group identity")
        g = cls(str(d["membership_digest"]), int(d["lifetime_ordinal"]), str(d["ordinal_source"]),
                tuple(int(r) for r in d["global_ranks"]), str(d["backend"]))
        _need(g.membership_digest == membership_digest(g.global_ranks, g.backend),
              "group identity (its membership digest does not match its ranks)")
        return g


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ArtifactError("merge_artifact_tampered", f"malformed {BOUNDARY_SCHEMA} {what}",
                            remedy="merge the artifacts the ranks saved, unedited; capture again if they were changed")


def check_boundary(payload: Any, where: str = "") -> dict[str, Any]:
    """Check a `collective_boundary_v1` payload's shape (typed `merge_artifact_tampered`)."""
    at = f" at {where}" if where else ""
    _need(isinstance(payload, dict) and payload.get("schema") == BOUNDARY_SCHEMA, f"payload{at}")
    for k in ("kind", "correlation_key", "rank", "group_rank", "world_size", "group", "geometry", "proof", "notes",
              "lifetime", "arming", "run_id"):
        _need(k in payload, f"payload{at} (no {k!r})")
    _need(payload["kind"] in KINDS, f"payload{at} (kind {payload['kind']!r})")
    key = payload["correlation_key"]
    _need(isinstance(key, dict) and isinstance(key.get("group_uid"), (list, tuple)) and len(key["group_uid"]) == 2
          and isinstance(key.get("seq"), int) and isinstance(key.get("channel"), str), f"correlation key{at}")
    group = GroupIdentity.from_dict(payload["group"])
    _need(list(group.group_uid) == list(key["group_uid"]), f"correlation key{at} (group uid is not the group's)")
    _need(int(payload["rank"]) in group.global_ranks, f"payload{at} (rank not in its group)")
    ArmingRecord.from_dict(payload["arming"])
    geo, proof = payload["geometry"], payload["proof"]
    _need(isinstance(geo, dict) and isinstance(geo.get("contributed"), list) and isinstance(geo.get("received"), list)
          and isinstance(geo.get("role"), str), f"geometry{at}")
    _need(isinstance(proof, dict) and isinstance(proof.get("contributed_digest"), list)
          and isinstance(proof.get("received_digest"), list)
          and len(proof["contributed_digest"]) == len(geo["contributed"])
          and len(proof["received_digest"]) == len(geo["received"]), f"proof{at}")
    return payload


def digest_encoded(enc: Any) -> str:
    """sha256 of an encoded payload (a codec's `EncodedPayload`: dtype tag, shape, layout tag,
    C-order element bytes). The capturing backend and the merge run this same function."""
    h = hashlib.sha256(f"{enc.dtype}|{tuple(enc.shape)}|{enc.meta.get('perm', '')}|".encode())
    h.update(enc.array.tobytes())
    return h.hexdigest()


def correlation(payload: dict[str, Any]) -> tuple:
    """The hashable correlation key of a boundary payload."""
    key = payload["correlation_key"]
    return (tuple(key["group_uid"]), key["channel"], int(key["seq"]))


__all__ = ["ArmingRecord", "GroupIdentity", "MergeAlignment", "MergeValueStatus", "BOUNDARY_SCHEMA", "KINDS",
           "ARMING_SOURCES", "DISTRIBUTED_SCOPES", "check_boundary", "correlation", "membership_digest", "digest_encoded"]
