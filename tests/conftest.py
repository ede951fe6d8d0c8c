import pytest

from vrl.plugins import registry


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test sees the plugins installed at that moment (some tests install or break plugins)."""
    registry.cache_clear()
    yield
    registry.cache_clear()
