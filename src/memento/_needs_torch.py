"""Imported first by `memento.torch`: without PyTorch, an ImportError that names the extra
to install."""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        'memento.torch needs PyTorch, which is not installed: pip install "memento-jax[torch]"',
        name="torch",
    ) from e
