import pytest
import torch

from vrl.plugins import registry

# One intra-op thread: the tiny models gain nothing from more, and on a loaded 2-core machine torch's
# thread pool makes generation 10-100x slower (measured while several test runs shared the cores).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test sees the plugins installed at that moment (some tests install or break plugins)."""
    registry.cache_clear()
    yield
    registry.cache_clear()
