"""Moved to `torchlens.replay.preconditions` (the replay layer sits below interventions); this name stays an alias
of that module."""

import sys

from torchlens.replay import preconditions as _moved

sys.modules[__name__] = _moved
