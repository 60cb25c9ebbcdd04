"""The toy task and the three transformer tasks: memento's meta-gradient equals the default."""

import jax
import numpy as np
import pytest

from memento_bench import transformer as tfm
from memento_bench.tasks import IMPLEMENTATIONS, TASKS, make_task
from memento_bench.toy import IMPLEMENTATIONS as TOY_IMPLEMENTATIONS, make_toy_task

TINY = tfm.TransformerConfig(
    vocab_size=16, seq_len=6, d_model=8, num_heads=2, num_layers=2, d_ff=16
)


def assert_trees_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-8, atol=1e-11), a, b)


# One task keeps the suite fast on CPU (each compiles two meta-gradients of the model);
# the other two share all of their machinery with the inner_loop tests.
@pytest.mark.parametrize("task", ["maml"])
def test_transformer_tasks_memento_equals_default(x64, task):
    assert task in TASKS
    grads = {}
    for impl, options in IMPLEMENTATIONS.items():
        meta_loss, eta, data = make_task(task, TINY, num_steps=2, batch_size=2, **options)
        grads[impl] = jax.jit(jax.grad(meta_loss))(eta, data)
    assert_trees_close(grads["memento"], grads["default"])


@pytest.mark.parametrize("variant", ["scan"])
def test_toy_implementations_agree(x64, variant):
    grads = {}
    for impl in ("default", "listing", "memento+remat+block"):
        assert impl in TOY_IMPLEMENTATIONS
        fn, args = make_toy_task(
            num_maps=2, variant=variant, implementation=impl, batch=4, dim=6, num_steps=2
        )
        grads[impl] = jax.jit(fn)(*args)
    for impl in grads:
        assert_trees_close(grads[impl], grads["default"])


def test_config_validates_heads():
    with pytest.raises(ValueError, match="num_heads=3 must divide d_model=8"):
        tfm.TransformerConfig(d_model=8, num_heads=3)
