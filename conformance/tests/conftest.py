pytest_plugins = ["torchlens_conformance.pytest_plugin"]
