"""Random inputs for the chunked Gated DeltaNet kernel (tests and benchmarks)."""

import mlx.core as mx


def random_gated_delta_inputs(B, T, Hk, Hv, Dk, Dv, seed=0, dtype=mx.float32):
    """Inputs in the regime the models produce (normalised q/k, g, beta in (0,1))."""
    keys = mx.random.split(mx.random.key(seed), 5)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0])
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    g = mx.exp(-mx.exp(mx.random.normal((B, T, Hv), key=keys[3]) - 2.0))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=keys[4]))
    return [x.astype(dtype) for x in (q, k, v)] + [g, beta]
