"""tinygrad's CPU device compiles kernels with clang (the setup script installs the Debian
package). Without a compiler the tests run on tinygrad's pure-Python device, and say so."""

import os
import shutil
import warnings

if shutil.which("clang") is None and "DEV" not in os.environ:
    os.environ["DEV"] = "PYTHON"
    warnings.warn("clang not found: the tinygrad tests run on tinygrad's pure-Python device (DEV=PYTHON), slowly",
                  stacklevel=1)


def pytest_report_header(config):
    if os.environ.get("DEV") == "PYTHON":
        return "tinygrad: no clang on PATH, running on the pure-Python device (DEV=PYTHON)"
    return None
