"""The recorder hook point of the reference framework: `RECORDER` is set during a capture."""

RECORDER = None
