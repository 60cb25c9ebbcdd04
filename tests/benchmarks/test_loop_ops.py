"""benchmarks/loop_ops.py at a tiny size: it counts each while loop's operations in the
optimized program, writes every field and renders its table."""

import json

import jax
import jax.numpy as jnp
from jax import lax

import loop_ops


def test_loop_operations_counts_each_loop_body_of_the_optimized_program():
    def loss(w, xs):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(w @ h + x),) * 2, jnp.zeros(8), xs)
        return jnp.sum(ys) + jnp.sum(h)

    args = jnp.eye(8), jnp.ones((50, 8))
    hlo = jax.jit(jax.grad(loss)).lower(*args).compile().as_text()
    counts = loop_ops.loop_operations(hlo)
    # A forward and a backward loop, each with a product among a few operations.
    assert len(counts["loop_bodies"]) == 2 and counts["loop_bodies"] == sorted(
        counts["loop_bodies"]
    )
    assert all(2 <= n <= 20 for n in counts["loop_bodies"]) and counts["compiled_whole"] >= 0


def test_main_writes_every_field_and_renders_the_table(tmp_path, capsys):
    out = tmp_path / "loop_ops.json"
    argv = ["--steps", "40", "--bodies", "matvec4", "--rounds", "1", "--threads", "all"]
    data = loop_ops.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    (result,) = data["results"]
    for name in ("lax.scan", "checkpoint per step", "nested sqrt(T)"):
        assert result[name]["temp_bytes"] > 0 and result[name]["time_s"] > 0
        assert result[name]["loop_bodies"]
    assert result["nested sqrt(T)"]["vs_nested"] == 1.0
    table = capsys.readouterr().out
    assert table.startswith("| body |") and "`tanh(W @ h + x)`, 4 floats" in table
