"""Zoo entries are read by core (`torchlens.backends.zoo`); re-exported for the suite."""

from torchlens.backends.zoo import REFERENCE_ULPS, ZooEntry, load_zoo, reference_tolerance

__all__ = ["ZooEntry", "load_zoo", "reference_tolerance", "REFERENCE_ULPS"]
