import pytest


@pytest.fixture
def x64():
    """Float64 for one test only: meta-gradients are compared to 1e-10 or so."""
    import jax  # here, so that tests/planning stays free of jax

    with jax.enable_x64(True):
        yield
