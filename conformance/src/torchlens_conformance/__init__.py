"""The shared backend conformance suite (filled by the validation and conformance issue).

Cells are generic over `BackendSpec.zoo`, so a third-party backend runs them unchanged.
"""

__version__ = "0.1.0"
