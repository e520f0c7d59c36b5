"""Data-parallel JAX training on two CPU devices: an overflow in one device's shard of the batch
makes every device skip the same step (shard_map and pmap with the flag all-reduced, and jit over
a sharded batch, where the gradients and so the flag are global)."""

import json
import os
import subprocess
import sys
import textwrap

from frameworks import require

require("jax")

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import polyamp as pa
    from polyamp.jax import step_if_finite
    from polyamp.scaling import COUNTERS

    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("data",))
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((8, 16)) / 3, jnp.float32), "b1": jnp.zeros(16),
              "w2": jnp.asarray(rng.standard_normal((16, 1)) / 4, jnp.float32)}
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = jnp.asarray(np.sin(x.sum(1, keepdims=True)))
    bad = x.copy()
    bad[1, 0] = 1e6  # row 1 lives on device 0; 1e6 is inf in float16
    opt = optax.adam(1e-2)
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rows = lambda a: jax.device_put(jnp.asarray(a), by_row)

    def loss_fn(p, x, y):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def arrays(state):
        return {k: getattr(state, k) for k in ("scale", *COUNTERS)}

    def host(tree):
        return jax.tree.map(lambda a: np.asarray(a).tolist(), tree)

    def shard_map_step(axis_name):
        mp = pa.MixedPrecision("fp16-mixed", framework="jax")
        value_and_grad = mp.value_and_grad(mp.autocast(loss_fn), axis_name=axis_name)

        def local(params, opt_state, state, x, y):
            (_, grads), finite, state = value_and_grad(params, x, y, state=state)
            grads = jax.lax.pmean(grads, "data")
            params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
            per_device = lambda tree: jax.tree.map(lambda a: a[None], tree)
            return per_device(params), per_device(arrays(state)), finite[None]

        step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("data"), P("data")),
                             out_specs=P("data"), check_vma=False)
        return mp, jax.jit(step)

    out = {}
    for axis_name in ("data", None):
        mp, step = shard_map_step(axis_name)
        per_params, per_state, finite = step(params, opt.init(params), mp.init(), rows(bad), rows(y))
        copies = [np.asarray(a) for a in jax.tree.leaves(per_params)]  # (device, ...) each
        out[f"shard_map axis_name={axis_name}"] = {
            "finite": host(finite),
            "scale": host(per_state["scale"]),
            "params_equal_across_devices": bool(all(np.array_equal(a[0], a[1]) for a in copies)),
            "params_unchanged": bool(all(np.array_equal(a[0], b) and np.array_equal(a[1], b)
                                         for a, b in zip(copies, jax.tree.leaves(params)))),
            "params_finite": bool(all(np.isfinite(a).all() for a in copies)),
        }
    mp, step = shard_map_step("data")
    per_params, _, finite = step(params, opt.init(params), mp.init(), rows(x), rows(y))
    copies = [np.asarray(a) for a in jax.tree.leaves(per_params)]
    same = bool(all(np.array_equal(a[0], a[1]) for a in copies))
    out["shard_map clean step"] = {"finite": host(finite), "params_equal_across_devices": same}

    mp = pa.MixedPrecision("fp16-mixed", framework="jax")
    value_and_grad = mp.value_and_grad(mp.autocast(loss_fn), axis_name="data")

    def pmap_local(params, opt_state, state, x, y):
        (_, grads), finite, state = value_and_grad(params, x, y, state=state)
        grads = jax.lax.pmean(grads, "data")
        params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
        return params, arrays(state), finite

    pmap_step = jax.pmap(pmap_local, axis_name="data", in_axes=(None, None, None, 0, 0))
    per_device = lambda a: np.asarray(a).reshape(2, -1, *np.shape(a)[1:])
    for name, batch in (("pmap overflow step", bad), ("pmap clean step", x)):
        per_params, per_state, finite = pmap_step(params, opt.init(params), mp.init(),
                                                  per_device(batch), per_device(y))
        copies = [np.asarray(a) for a in jax.tree.leaves(per_params)]
        out[name] = {
            "finite": host(finite),
            "scale": host(per_state["scale"]),
            "params_equal_across_devices": bool(all(np.array_equal(a[0], a[1]) for a in copies)),
            "params_unchanged": bool(all(np.array_equal(a[0], b) and np.array_equal(a[1], b)
                                         for a, b in zip(copies, jax.tree.leaves(params)))),
        }

    mp = pa.MixedPrecision("fp16-mixed", framework="jax")
    value_and_grad = mp.value_and_grad(mp.autocast(loss_fn))

    @jax.jit
    def sharded_step(params, opt_state, state, x, y):
        (_, grads), finite, state = value_and_grad(params, x, y, state=state)
        params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
        return params, opt_state, state, finite

    p0 = jax.device_put(params, replicated)
    state = mp.init()
    results = []
    for batch in (bad, x):
        xs = rows(batch)
        assert len(xs.addressable_shards) == 2
        p1, _, state, finite = sharded_step(p0, opt.init(p0), state, xs, rows(y))
        shards = [[np.asarray(s.data) for s in a.addressable_shards] for a in jax.tree.leaves(p1)]
        results.append({"finite": bool(finite), "scale": float(state.scale),
                        "replicas_equal": bool(all(np.array_equal(s[0], s[1]) for s in shards)),
                        "params_unchanged": bool(all(np.array_equal(a, b) for a, b in
                                                     zip(jax.tree.leaves(p1), jax.tree.leaves(p0)))),
                        "params_finite": bool(all(np.isfinite(a).all() for a in jax.tree.leaves(p1)))})
    out["jit sharded batch"] = results
    print(json.dumps(out))
    """
)


def test_devices_agree_on_skipping():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    agreed = out["shard_map axis_name=data"]
    assert agreed["finite"] == [False, False] and agreed["scale"] == [2.0**15, 2.0**15]
    assert agreed["params_unchanged"] and agreed["params_equal_across_devices"]
    # without the all-reduced flag, device 1 (clean shard) steps with the averaged NaN gradients
    alone = out["shard_map axis_name=None"]
    assert alone["finite"] == [False, True] and not alone["params_finite"]
    clean = out["shard_map clean step"]
    assert clean["finite"] == [True, True] and clean["params_equal_across_devices"]

    # pmap: the overflow on device 0 halves the scale and skips the step on both devices
    for name, finite, scale in (("pmap overflow step", False, 2.0**15), ("pmap clean step", True, 2.0**16)):
        result = out[name]
        assert result["finite"] == [finite, finite] and result["scale"] == [scale, scale]
        assert result["params_equal_across_devices"] and result["params_unchanged"] is not finite

    skipped, stepped = out["jit sharded batch"]
    assert not skipped["finite"] and skipped["scale"] == 2.0**15 and skipped["params_unchanged"]
    assert skipped["replicas_equal"] and skipped["params_finite"]
    assert stepped["finite"] and not stepped["params_unchanged"] and stepped["replicas_equal"]
