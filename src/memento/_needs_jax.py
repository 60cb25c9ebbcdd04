"""Imported first by the parts of memento that run on JAX (`memento.loops`, `memento.meta`,
`memento.diffrax`): without jax, an ImportError that names the extra to install."""

try:
    import jax  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "memento.scan, while_loop, chain, fwdrev_grad and memento.loops, meta and diffrax "
        'need jax, which is not installed: pip install "memento-jax[jax]"',
        name="jax",
    ) from e
