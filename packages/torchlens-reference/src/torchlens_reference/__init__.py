"""torchlens-reference: a toy TorchLens backend over a tiny numpy framework (`nn`, `ops`)."""

__version__ = "0.1.0"
