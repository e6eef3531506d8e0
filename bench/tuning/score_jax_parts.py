"""Where does the JAX score driver's time go? (a trial behind bench/score.py)

Times, on the Qwen2.5-0.5B shape at ``B`` x 1,024 tokens, bf16, each jitted alone after a
warm-up (median of 5, host wall time around ``block_until_ready``): the family's forward
(``hidden``), the forward plus the output projection over every position in chunks (no
logprob op), the whole score program, the attention alone (``jax.nn.dot_product_attention``
with cuDNN and with XLA's implementation), and the MLP's two matrix products alone.

Run: ``python bench/tuning/score_jax_parts.py [--batch 64]`` on the GPU; prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwen_shape import FULL  # noqa: E402


def _ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    from trace_replay_app.drivers import jax_score
    from trace_replay_app.models.llama import jax_loop
    from trace_replay_app.models.llama.config import seeded_weights
    from trace_replay_app.models.llama.hf import config_from_hf

    config = config_from_hf(dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6, **FULL["sizes"]))
    weights = seeded_weights(config, 0)
    dev = jax.devices()[0]
    params = jax_loop.JAX.model(config, weights, device="cuda", dtype="bfloat16")[1]
    b, n = a.batch, 1024
    tokens = jax.device_put(np.random.default_rng(0).integers(0, config.vocab_size, (b, n)).astype(np.int32), dev)
    rows = []

    for impl in ("xla", "cudnn"):
        hidden = jax.jit(lambda p, t, impl=impl: jax_loop._hidden(p, config, t, impl))
        rows.append((f"hidden (forward), attention {impl}", _ms(hidden, params, tokens)))

    def projected(p, t):
        h = jax_loop._hidden(p, config, t, "cudnn").reshape(-1, config.hidden_size)
        return jax.lax.map(lambda x: jnp.max(jax_loop._logits(p, x), axis=-1), h.reshape(-1, 4096, h.shape[-1]))

    rows.append(("hidden + output projection (max per row)", _ms(jax.jit(projected), params, tokens)))
    m = b * (n - 1)
    padded = -(-m // 4096) * 4096
    flat = jax.device_put(np.arange(padded, dtype=np.int32) % (b * n), dev)
    score = lambda p, t, r: jax_score._score(  # noqa: E731
        p, t, r, r, family=jax_loop.JAX, config=config, chunk=4096, attention="cudnn"
    )
    rows.append(("whole score program", _ms(score, params, tokens, flat)))
    q = jnp.ones((b, n, 14, 64), jnp.bfloat16)
    kv = jnp.ones((b, n, 2, 64), jnp.bfloat16)
    for impl in ("cudnn", "xla"):
        try:
            f = jax.jit(
                lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            )
            rows.append((f"attention alone x 24 layers ({impl})", 24 * _ms(f, q, kv, kv)))
        except Exception as exc:  # noqa: BLE001 - a trial: report what failed
            rows.append((f"attention ({impl}) failed: {type(exc).__name__}: {str(exc)[:80]}", float("nan")))
    x = jnp.ones((b * n, 896), jnp.bfloat16)
    w1, w2 = jnp.ones((896, 9728), jnp.bfloat16), jnp.ones((4864, 896), jnp.bfloat16)
    mlp = jax.jit(lambda x, w1, w2: jnp.matmul(jax.nn.silu(jnp.matmul(x, w1)[:, :4864]), w2))
    rows.append(("MLP products alone x 24 layers", 24 * _ms(mlp, x, w1, w2)))
    print(f"batch {b} x {n}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} ms |")


if __name__ == "__main__":
    main()
