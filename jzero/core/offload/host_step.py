"""The optimizer step on the host (``Offload(optimizer="host")``): ZeRO-Offload as run.

ZeRO-Offload (Ren et al. 2021) and DeepSpeed's CPU Adam get their gain on one GPU by
running the optimizer step on the host: the sharded Optax state and fp32 master weights
rest in pinned host memory and never come to the device; only the gradient shards go
down, in the reduce dtype, and the new parameters come up, in the parameter dtype. The
device holds neither the state nor the master weights and does no optimizer work.

Design: the Optax update is split as the streamed mode splits
it (:func:`.split.split_update`): a global part (counters, a global gradient norm) and one
bucket per parameter leaf. The global part runs on the device, on the fp32 gradients the
step already holds for its metrics; its small results (scalars such as the clip factor or
Adam's count) go down to host memory. Each bucket then runs as its own jitted function
as a host computation (``compute_on(f, compute_type="device_host", ...)``,
:mod:`jzero.internal.host_compute`): it reads its leaf's gradient shard (moved down with
``jax.device_put(g, jax.memory.Space.Host)`` in backward or after it, see Overlap, in the
dtype the gradients were reduced in), unpads and divides it there exactly as the step
does on the device, evaluates the bucket's traced equations on the host-resident state and
master weights, and writes the new state and master weights back in place in host memory;
only the new parameter (cast to the parameter dtype) is copied up. A transformation that
does not split (e.g. a clip of the *updates* after Adam) runs as one bucket, the whole
update on the host.

Overlap: at stages 2-3 backward moves each offloaded leaf's gradient shard to host memory
where it reduce-scatters it (ZeRO-Offload's copy during backward;
:func:`jzero.core.comm.reducer.makes_host_copies`): an unrolled model's layer by layer,
a scanned stack's at stage 3 layer by layer inside the backward loop (each slice written
into the host-resident stacked gradient). Elsewhere (stage 1, gradient accumulation,
prefetch, hpZ, a ``replica`` axis) each gradient is copied down after backward. The
buckets have no data dependencies on one another, so XLA may copy leaf k+1's gradient
down (and leaf k-1's parameter up) while the host updates leaf k; jzero forces no order.
What runs where on a GPU: forward, backward, the gradient reduce-scatter, the global part
and stage 1/2's parameter all-gather on the GPU; every bucket's update on the host CPU.
A bucket whose update itself needs a collective (a factored moment over a sharded axis,
e.g. Adafactor at N > 1) is a host computation with a collective, which XLA:GPU may not
compile; on one GPU (the case ZeRO-Offload is for) there is none. On XLA:CPU the host and
the device are the same memory and silicon, so the tests check placement by memory kind
(and, for the moves XLA:CPU lowers to nothing, the step lowered for ``cuda``) and
numerics (bitwise those without offload), not speed.

Compiled for a GPU: XLA:GPU refused two shapes of this program (seen on an H200), so
gradients go down row-major (:mod:`jzero.core.host_memory`) and a bucket's result that
was moved to host memory inside it leaves through an ``optimization_barrier``;
``tests/core/offload/test_host_step_gpu_compile.py`` compiles the step for a compile-only
GPU.

When each mode is faster: the host step moves about 2 + 2 bytes per parameter per step
over PCIe (16-bit gradients down, 16-bit parameters up) but updates at the host's memory
bandwidth; the streamed mode (``"stream"``) moves the whole state both ways (2·K bytes
per parameter, K = 12 for Adam's master + two moments) and updates at the GPU's. With a
fast link and a slow or busy host (few cores, other work) streaming wins; with a big
state per GPU link (one GPU, large model), the host step moves about 6x less.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

from ...internal import interpret
from ...internal.equation import Equation, defined, environment, equations
from ...internal.host_compute import on_host
from ...internal.interpret import REBINDS, Interpreter, bind, rebind
from ...internal.interpret import value as read
from ...internal.moved import InternalMoved
from .. import host_memory
from ..grad_average import averaged
from ..grad_reduction import Gradients
from ..options.offload import HOST
from ..options.precision import Precision
from ..plan import Plan, Stored
from ..stored_form import store, to_device, to_host, view
from ..update_inputs import UpdateInputs, keep_if_finite
from .split import Bucket, Split, evaluate, split_update


def host_update(step: UpdateInputs) -> tuple[Any, Any, Any]:
    """The Optax update run on the host, one parameter leaf at a time
    (:class:`UpdateInputs`): the stored Optax state and master weights in host memory
    (parameters without master weights are copied down from the device), the new state
    and master weights returned there."""
    tx, precision, plan, grads, opt_state, weights, finite = step
    split = split_update(tx, plan)
    o, w, n = jax.tree.leaves(opt_state), jax.tree.leaves(weights), len(plan.params)
    env, shared = _global_part(split, plan, grads, o, finite)
    new_o, new_p, new_w = [shared.get(j, x) for j, x in enumerate(o)], [None] * n, [None] * n
    reduced = grads.host_reads()
    common = _down((grads.denominator, finite))
    for b in split.buckets:
        if not _on_host(plan, b):  # Offload.ratio: this leaf's state rests on the device
            outs = _device_bucket(split, b, plan, precision, env, (o, w), finite)
            _collect(plan, b, outs, (new_o, new_p, new_w))
            continue
        free = _free(split, b, plan)
        ins = (
            [host_memory.to_host(reduced[i]) for i in b.params],  # row-major, see there
            [host_memory.put_on_host(o[j]) for j in b.opt],  # a copy only for one on the device
            _down([w[i] for i in b.params]),
            _down([env[v] for v in free]),
        )
        outs = _bucket_program(split, b, plan, precision, free, finite is not None)(*ins, *common)
        _collect(plan, b, outs, (new_o, new_p, new_w))
    master = None if plan.master is None else jax.tree.unflatten(plan.params_def, new_w)
    return (
        jax.tree.unflatten(plan.params_def, new_p),
        jax.tree.unflatten(plan.opt_def, new_o),
        master,
    )


def _collect(plan: Plan, b: Bucket, outs: tuple, new: tuple[list, list, list]) -> None:
    """A bucket's ``(state, master, params)`` written into the step's new leaves: state and
    master at rest where the plan stores them, parameters on the device."""
    new_o, new_p, new_w = new
    for j, x in zip(b.opt, outs[0]):
        new_o[j] = _at_rest(plan, x, plan.opt[j])
    for i, x in zip(b.params, outs[1]):
        new_w[i] = _at_rest(plan, x, plan.master[i])
    for i, x in zip(b.params, outs[2]):
        new_p[i] = jax.device_put(x, jax.memory.Space.Device)


def _on_host(plan: Plan, b: Bucket) -> bool:
    """Whether bucket ``b`` runs on the host: some of its state or master weights rest
    there. A bucket with neither (e.g. plain SGD at fp32) runs there only when the whole
    state is offloaded (``Offload.ratio`` 1), as it did before ratios."""
    held = [plan.opt[j] for j in b.opt] + [plan.master[i] for i in b.params if plan.master]
    if not held:
        return plan.config.offload.ratio == 1
    return any(s.memory_kind == HOST for s in held)


def _device_bucket(split, b, plan, precision, env, sources, finite) -> tuple[list, list, list]:
    """Bucket ``b`` evaluated on the device, beside the host buckets (its state and master
    weights rest there, ``Offload.ratio`` < 1): ``(state, master, params)`` as the host
    program returns them, from the averaged gradients already in ``env``."""
    (o, w), weights = sources, plan.master or plan.params
    keep = functools.partial(keep_if_finite, finite)
    for j in b.opt:
        env[split.state_ins[j]] = view([o[j]], [plan.opt[j]])[0]
    for i in b.params:
        env[split.weight_ins[i]] = view(to_device(plan, [w[i]], [weights[i]]), [weights[i]])[0]
    evaluate(split, b.equations, env)
    return _results(split, b, plan, precision, env, keep)


def _results(split: Split, b: Bucket, plan: Plan, precision: Precision, env: dict, keep) -> tuple:
    """A bucket's evaluated values as ``(stored state, stored master, params)``: the new
    state and weights where ``keep`` takes them (else the old), the parameters cast."""
    new_state = lambda j: keep(read(env, split.state_outs[j]), env[split.state_ins[j]])
    new_opt = [store([new_state(j)], [plan.opt[j]])[0] for j in b.opt]
    new_master, new_params = [], []
    for i in b.params:
        old = env[split.weight_ins[i]]
        new = keep(optax.apply_updates(old, read(env, split.update_outs[i])), old)
        if plan.master is not None:
            new_master.append(store([new], [plan.master[i]])[0])
        new_params.append(precision.cast(new))
    return new_opt, new_master, new_params


def _global_part(
    split: Split, plan: Plan, grads: Gradients, o: list, finite: jax.Array | None
) -> tuple[dict, dict[int, jax.Array]]:
    """Evaluates the update's global part on the device (counters, global norms), from the
    averaged gradients; the environment, and the new shared state leaves (host memory)."""
    env = environment(split.jaxpr, jax.tree.leaves(grads.averaged))
    here = lambda j: view(to_device(plan, [o[j]], [plan.opt[j]]), [plan.opt[j]])[0]
    env |= {split.state_ins[j]: here(j) for j in split.shared}
    evaluate(split, split.first, env)
    keep = functools.partial(keep_if_finite, finite)
    shared = {}
    for j in split.shared:
        new = keep(read(env, split.state_outs[j]), env[split.state_ins[j]])
        shared[j] = to_host(plan, store([new], [plan.opt[j]]), [plan.opt[j]])[0]
    return env, shared


def _down(xs: Any) -> Any:
    """``xs`` (arrays, or None) in host memory (a row-major copy for those on the device)."""
    return jax.tree.map(host_memory.to_host, xs)


def _at_rest(plan: Plan, x: jax.Array, stored: Stored) -> jax.Array:
    """A bucket's output ``x`` with its planned sharding, in the memory the plan stores it in
    (host memory; the device for a leaf ``Offload.ratio`` leaves there)."""
    sharding = plan.compute_sharding(stored)  # the constraint fixes the layout, the
    if stored.memory_kind is None:  # put: the memory
        sharding = sharding.with_memory_kind("device")
    return jax.device_put(jax.lax.with_sharding_constraint(x, sharding), sharding)


def _free(split: Split, bucket: Bucket, plan: Plan) -> list[Any]:
    """The variables ``bucket``'s equations read from outside it, other than its own
    gradients, state and weights: the global part's results, constants, shared state."""
    own = {split.grad_ins[i] for i in bucket.params} | {split.state_ins[j] for j in bucket.opt}
    own |= {split.weight_ins[i] for i in bucket.params}
    all_eqns = equations(split.jaxpr)
    made, free = set(), []
    for eqn in (all_eqns[e] for e in bucket.equations):
        free += [v for v in eqn.variables if v not in made and v not in own and v not in free]
        made.update(eqn.outputs)
    outs = [split.update_outs[i] for i in bucket.params]
    outs += [split.state_outs[j] for j in bucket.opt]  # e.g. one passed through
    named = defined(split.jaxpr)  # its outputs that are no literal
    return free + [v for v in outs if v in named and v not in made | own | set(free)]


class _OnHost(Interpreter):
    """A bucket's equations in a host computation: every value they make rests in host
    memory (a constant or an iota with no host input is made in device memory by JAX, and
    would not meet the host values it is combined with). ``moved`` holds the ids of the
    values it moved there (Adam's count, made from the constant 1)."""

    def __init__(self) -> None:
        self.moved: set[int] = set()

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any]:
        outs = None
        if eqn.kind in REBINDS:
            try:
                outs = rebind(eqn, values, self)
            except InternalMoved:  # bound whole as traced: its results moved after it
                outs = None
        outs = bind(eqn, values) if outs is None else outs
        placed = [host_memory.put_on_host(x) for x in outs]
        self.moved.update(id(y) for x, y in zip(outs, placed) if y is not x)
        return placed

    def returned(self, results: Any) -> Any:
        """``results`` as the host computation returns them. XLA:GPU drops the memory
        moves inside a host computation and cannot when one is returned and also read
        inside (Adam's count): such a value leaves through an ``optimization_barrier``, a
        fresh value (tests/core/offload/test_host_step_gpu_compile.py). Only those: a
        barrier over the whole results would keep every one of them live at once."""
        fresh = lambda x: jax.lax.optimization_barrier(x) if id(x) in self.moved else x
        return jax.tree.map(fresh, results)


def _bucket_program(
    split: Split,
    bucket: Bucket,
    plan: Plan,
    precision: Precision,
    free: list[Any],
    guarded: bool,
) -> Any:
    """The jitted host computation of one bucket: ``(reduced grads, stored state, stored
    weights, free values, denominator, finite) -> (stored state, stored master, params)``."""
    weights: tuple[Stored, ...] = plan.master or plan.params

    def update(reduced, opt, w, values, denominator, finite):
        keep = functools.partial(keep_if_finite, finite if guarded else None)
        env = dict(zip(free, values))
        for i, g in zip(bucket.params, reduced):  # as the step averages them on the device
            env[split.grad_ins[i]] = averaged(g, denominator, plan.params[i].layout)
        for j, x in zip(bucket.opt, opt):
            env[split.state_ins[j]] = view([x], [plan.opt[j]])[0]
        for i, x in zip(bucket.params, w):
            env[split.weight_ins[i]] = view([x], [weights[i]])[0]
        host = _OnHost()
        interpret.evaluate(split.jaxpr, env, host, bucket.equations)
        return host.returned(_results(split, bucket, plan, precision, env, keep))

    return on_host(jax.jit(update, donate_argnums=(1,)))
