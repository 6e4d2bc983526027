"""JAX backend tests: the `slow` marker (the largest real-model zoo configurations)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a larger model; deselect with -m 'not slow'")
