"""The three bilevel tasks of MixFlow-MG (section 5.2) on the plain-JAX transformer.

- ``"learning_rates"``: eta holds per-parameter log learning rates of the inner Adam
  (hyperparameter learning, Bengio 2000; Maclaurin et al. 2015).
- ``"maml"``: eta is the inner loop's initial point, ``theta_0 = eta`` (Finn et al. 2017).
- ``"loss_weighting"``: eta parameterises a transformer of the same architecture that
  weighs each training sequence, ``L = alpha(eta, x) * NTP(theta, x)`` (after Hu et al.).

Each returns ``meta_loss(eta, data)``: T inner Adam steps with `memento.meta.inner_loop`,
then the next-token loss of the adapted model on a validation batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from memento.meta import inner_loop

from .transformer import (
    TransformerConfig,
    apply,
    init_params,
    ntp_loss,
    synthetic_tokens,
    token_losses,
)

TASKS = ("learning_rates", "maml", "loss_weighting")
INNER_LEARNING_RATE = 3e-3
# Adam's eps_root must be positive for meta-gradients (see inner_loop's Raises).
EPS_ROOT = 1e-12

# The paper's comparison (section 5): both keep block and per-step rematerialisation;
# only MixFlow-MG differentiates forward-over-reverse and saves the inner gradients.
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "default": {"mode": "revrev", "remat": True, "save_inner_grads": False},
    "memento": {"mode": "fwdrev", "remat": True, "save_inner_grads": True},
}


def task_batches(
    key: jax.Array, config: TransformerConfig, *, num_steps: int, batch_size: int
) -> dict[str, Any]:
    """Fresh synthetic batches for one outer step of any task.

    Returns:
        ``{"train": [num_steps, batch_size, seq_len + 1], "val": [batch_size, seq_len + 1]}``
        token ids (`memento_bench.transformer.synthetic_tokens`).
    """
    k_train, k_val = jax.random.split(key)
    tokens_shape = (batch_size, config.seq_len + 1)
    return {
        "train": synthetic_tokens(k_train, (num_steps, *tokens_shape), config.vocab_size),
        "val": synthetic_tokens(k_val, tokens_shape, config.vocab_size),
    }


def sequence_weights(eta: Any, tokens: jax.Array, config: TransformerConfig) -> jax.Array:
    """The loss-weighting task's alpha(eta, x) in (0, 2): one weight per sequence.

    The meta-transformer ``eta`` reads the sequence; the mean of its first output logit
    over positions, squashed by ``2 sigmoid``, is the weight (1 when that logit is 0).
    """
    score = jnp.mean(apply(eta, tokens[:, :-1], config)[..., 0], axis=-1)
    return 2.0 * jax.nn.sigmoid(score)


def make_task(
    task: str,
    config: TransformerConfig,
    *,
    num_steps: int,
    batch_size: int,
    seed: int = 0,
    **inner_options: Any,
) -> tuple[Callable[[Any, Any], jax.Array], Any, Any]:
    """Returns ``(meta_loss, eta, data)`` for one of `TASKS`.

    Args:
        task: ``"learning_rates"``, ``"maml"`` or ``"loss_weighting"``.
        config: The inner model (and, for loss weighting, the meta-model).
        num_steps: T, inner updates per outer update.
        batch_size: Sequences per inner batch (and in the validation batch).
        seed: For parameters and synthetic tokens.
        **inner_options: Passed to `inner_loop` (``mode``, ``remat``, ``memory``...).

    Returns:
        ``meta_loss(eta, data) -> scalar``, initial meta-parameters, and data: a dict
        with the inner batches ``"train"`` ``[T, batch, seq_len + 1]``, the validation
        batch ``"val"`` and, where eta is not the initial point, ``"init"`` parameters.
    """
    if task not in TASKS:
        raise ValueError(
            f"memento_bench.tasks.make_task: task must be one of {TASKS}, got {task!r}."
        )
    k_init, k_meta, k_data = jax.random.split(jax.random.PRNGKey(seed), 3)
    data = task_batches(k_data, config, num_steps=num_steps, batch_size=batch_size)
    theta0 = init_params(k_init, config)

    def plain_loss(theta, _eta, tokens):
        return ntp_loss(theta, tokens, config)

    if task == "maml":
        eta = theta0
        opt = optax.adam(INNER_LEARNING_RATE, eps_root=EPS_ROOT)

        def meta_loss(eta, data):
            theta = inner_loop(plain_loss, opt, eta, eta, data["train"], **inner_options)
            return ntp_loss(theta, data["val"], config)

        return meta_loss, eta, data

    data["init"] = theta0
    if task == "learning_rates":
        eta = jax.tree.map(lambda p: jnp.full(p.shape, jnp.log(INNER_LEARNING_RATE)), theta0)

        def optimizer(eta):
            # Adam's direction, scaled per parameter by exp(eta): g(eta, grad, theta, v).
            scale = optax.stateless(
                lambda updates, _: jax.tree.map(lambda u, lr: -jnp.exp(lr) * u, updates, eta)
            )
            return optax.chain(optax.scale_by_adam(eps_root=EPS_ROOT), scale)

        def meta_loss(eta, data):
            theta = inner_loop(
                plain_loss, optimizer, data["init"], eta, data["train"], **inner_options
            )
            return ntp_loss(theta, data["val"], config)

        return meta_loss, eta, data

    eta = init_params(k_meta, config)
    opt = optax.adam(INNER_LEARNING_RATE, eps_root=EPS_ROOT)

    def weighted_loss(theta, eta, tokens):
        weights = sequence_weights(eta, tokens, config)
        return jnp.mean(weights * token_losses(theta, tokens, config))

    def meta_loss(eta, data):
        theta = inner_loop(weighted_loss, opt, data["init"], eta, data["train"], **inner_options)
        return ntp_loss(theta, data["val"], config)

    return meta_loss, eta, data
