"""Fixtures come from the shared plugin module `torchlens_torch.testing`.

They are imported rather than listed in `pytest_plugins`, because pytest accepts
`pytest_plugins` only in the rootdir conftest and this suite also runs from the repo root.
"""

from torchlens_torch.testing import build_zoo, restore_rng, zoo_case, zoo_name  # noqa: F401
