"""Run as a script by test_jax_real_two_devices.py, in a fresh process with two host CPU
devices (XLA_FLAGS must be set before jax is imported, so it cannot run in the test
process). Prints one JSON line of findings; the test asserts on them."""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import torchlens as tl  # noqa: E402


def _independent(fn, args):
    """(primitive name, outputs) per equation of JAX's own jaxpr of `fn`, evaluated by binding
    each primitive to the previous results (stepping into pjit calls); shares no torchlens code."""
    closed = jax.make_jaxpr(fn)(*args)
    trail = []

    def run(jaxpr, consts, vals):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, vals))
        read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in ("pjit", "jit", "custom_jvp_call"):
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                outs = run(inner.jaxpr, inner.consts, ins)
            else:
                out = eqn.primitive.bind(*ins, **eqn.params)
                outs = list(out) if eqn.primitive.multiple_results else [out]
                trail.append((eqn.primitive.name, outs))
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    run(closed.jaxpr, closed.consts, list(args))
    return trail


def main() -> None:
    found: dict = {"devices": jax.device_count()}
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def mlp(x, w1, w2):
        h = jax.nn.relu(x @ w1)
        h = jax.lax.with_sharding_constraint(h, rows)
        return jnp.tanh(h @ w2)

    f = jax.jit(mlp, in_shardings=(rows, rep, rep), out_shardings=rows)
    x = jax.device_put(jnp.linspace(-1, 1, 16, dtype=jnp.float32).reshape(4, 4), rows)
    w1 = jax.device_put(jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 24 - 0.5, rep)
    w2 = jax.device_put(jnp.arange(18, dtype=jnp.float32).reshape(6, 3) / 18 - 0.5, rep)
    t = tl.trace(f, x, w1, w2, backend="jax")
    ops = [o for o in t.ops if o.kind == "op"]
    trail = _independent(f, (x, w1, w2))
    found["names"] = [o.func_name for o in ops]
    found["independent_names"] = [n for n, _ in trail]
    found["values_equal"] = len(ops) == len(trail) and all(
        np.array_equal(np.asarray(o.out), np.asarray(outs[0])) for o, (_, outs) in zip(ops, trail))
    found["output_equal"] = bool(np.array_equal(np.asarray(t.output_ops[0].out), np.asarray(f(x, w1, w2))))
    found["sharded_ops"] = sum(1 for o in ops if "in_shardings" in o.meta)
    found["live_valid"] = bool(t.validate_forward_pass())
    with tempfile.TemporaryDirectory() as d:
        t.save(os.path.join(d, "pjit.tlspec"))
        loaded = tl.load(os.path.join(d, "pjit.tlspec"))
        found["loaded_valid"] = bool(loaded.validate_forward_pass())
        found["loaded_rebound"] = sorted({type(o.func).__name__ for o in loaded.ops if o.kind == "op"})
    # a shard_map whose body holds a collective, on both devices: one op, validated live
    def sm(a):
        return jax.shard_map(lambda b: jax.lax.psum(jnp.tanh(b), "d"), mesh=mesh, in_specs=P("d"), out_specs=P())(a) + 1.0

    t2 = tl.trace(sm, x, backend="jax")
    found["shard_map_names"] = [o.func_name for o in t2.ops if o.kind == "op"]
    found["shard_map_output_equal"] = bool(np.array_equal(np.asarray(t2.output_ops[0].out), np.asarray(sm(x))))
    found["shard_map_live_valid"] = bool(t2.validate_forward_pass())
    with tempfile.TemporaryDirectory() as d:
        t2.save(os.path.join(d, "sm.tlspec"))
        try:
            tl.load(os.path.join(d, "sm.tlspec")).validate_forward_pass()
            found["shard_map_loaded"] = "validated"
        except Exception as exc:  # noqa: BLE001 - the finding is the typed code
            found["shard_map_loaded"] = getattr(exc, "code", type(exc).__name__)
    print(json.dumps(found))


if __name__ == "__main__":
    sys.exit(main())
