"""A small decoder-only transformer in plain JAX, for the meta-learning tasks of MixFlow-MG.

Why plain JAX with dict pytrees rather than Flax or Haiku: memento's runtime dependencies
are jax, numpy and optax only, and the meta-gradient machinery needs nothing from a
module system. Parameters are a nested dict, so optax, ``jax.tree`` and per-parameter
meta-parameters (learning rates shaped like the parameters) apply directly, and the
whole model is ~100 lines a reader can check.

Architecture: token and learned position embeddings, ``num_layers`` pre-norm residual
blocks (causal multi-head attention, then a GELU MLP), RMS norms, untied output head.
The layers' parameters are stacked on a leading axis and the blocks run in a
``lax.scan`` whose body is ``jax.checkpoint``-ed: per-block rematerialisation (MixFlow-MG,
section 4, "block rematerialisation"), with a compile time that does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the decoder-only transformer.

    Attributes:
        vocab_size: Number of token ids.
        seq_len: Maximum sequence length (size of the position table).
        d_model: Width of the residual stream.
        num_heads: Attention heads; must divide `d_model`.
        num_layers: Residual blocks.
        d_ff: Hidden width of the MLP.
        block_remat: ``jax.checkpoint`` each block (the paper keeps it on for both the
            baseline and MixFlow-MG).
    """

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 256
    block_remat: bool = True

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f"memento_bench.transformer.TransformerConfig: num_heads={self.num_heads} must divide d_model={self.d_model}."
            )

    @property
    def num_params(self) -> int:
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        per_block = 4 * d * d + 2 * d * f + 2 * d
        return v * d + self.seq_len * d + self.num_layers * per_block + d + d * v


def init_params(key: jax.Array, config: TransformerConfig) -> dict:
    """Random initial parameters (scaled normal), as a dict pytree."""
    c = config
    ks = jax.random.split(key, 8)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape) / math.sqrt(fan_in)

    layers = c.num_layers
    return {
        "embed": 0.02 * jax.random.normal(ks[0], (c.vocab_size, c.d_model)),
        "pos": 0.02 * jax.random.normal(ks[1], (c.seq_len, c.d_model)),
        "blocks": {
            "norm1": jnp.ones((layers, c.d_model)),
            "qkv": normal(ks[2], (layers, c.d_model, 3 * c.d_model), c.d_model),
            "out": normal(ks[3], (layers, c.d_model, c.d_model), c.d_model) / layers,
            "norm2": jnp.ones((layers, c.d_model)),
            "up": normal(ks[4], (layers, c.d_model, c.d_ff), c.d_model),
            "down": normal(ks[5], (layers, c.d_ff, c.d_model), c.d_ff) / layers,
        },
        "final_norm": jnp.ones((c.d_model,)),
        "head": normal(ks[6], (c.d_model, c.vocab_size), c.d_model),
    }


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(x, p, num_heads: int):
    """One pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""
    batch, seq, d = x.shape
    h = _rms_norm(x, p["norm1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(batch, seq, num_heads, d // num_heads) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // num_heads)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    x = x + attn.reshape(batch, seq, d) @ p["out"]
    h = _rms_norm(x, p["norm2"])
    return x + jax.nn.gelu(h @ p["up"]) @ p["down"]


def apply(params: dict, tokens: jax.Array, config: TransformerConfig) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` for integer `tokens` ``[batch, seq]``."""
    seq = tokens.shape[-1]
    x = jnp.take(params["embed"], tokens, axis=0) + params["pos"][:seq]

    def body(x, p):
        return _block(x, p, config.num_heads), None

    if config.block_remat:
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, params["blocks"])
    return _rms_norm(x, params["final_norm"]) @ params["head"]


def token_losses(params: dict, tokens: jax.Array, config: TransformerConfig) -> jax.Array:
    """Next-token-prediction loss per sequence, ``[batch]`` (NTP in MixFlow-MG)."""
    logits = apply(params, tokens[:, :-1], config)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked, axis=-1)


def ntp_loss(params: dict, tokens: jax.Array, config: TransformerConfig) -> jax.Array:
    """Mean next-token-prediction loss."""
    return jnp.mean(token_losses(params, tokens, config))


def synthetic_tokens(key: jax.Array, shape: tuple[int, ...], vocab_size: int) -> jax.Array:
    """Token sequences from a fixed random bigram chain: learnable, not memorisable.

    Each token is followed by one of 4 successors drawn from a table that depends only on
    `vocab_size`, so every batch shares the same structure.
    """
    table = jax.random.randint(jax.random.PRNGKey(1234), (vocab_size, 4), 0, vocab_size)
    *lead, length = shape
    k_first, k_next = jax.random.split(key)
    first = jax.random.randint(k_first, tuple(lead), 0, vocab_size)
    choices = jax.random.randint(k_next, (length - 1, *lead), 0, 4)

    def step(tok, choice):
        nxt = table[tok, choice]
        return nxt, nxt

    _, rest = jax.lax.scan(step, first, choices)
    return jnp.concatenate([first[..., None], jnp.moveaxis(rest, 0, -1)], axis=-1)
