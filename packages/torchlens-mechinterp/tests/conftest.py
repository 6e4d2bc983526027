"""The mechinterp kit's tests: put this directory on sys.path so `from mi_models import ...` works."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
