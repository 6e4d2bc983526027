"""Zoo entries are read by core (`torchlens.backends.zoo`); re-exported for the suite."""

from torchlens.backends.zoo import ZooEntry, load_zoo

__all__ = ["ZooEntry", "load_zoo"]
