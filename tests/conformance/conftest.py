import jax
import pytest


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield
