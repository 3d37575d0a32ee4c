"""Logical axis rules (``rules=``) on ``ZeroOptimizer`` and both Flax adapters.

A small Linen LM annotated with ``nn.with_logical_partitioning`` (MaxText style) on a
``('data', 'model')`` mesh: every leaf is laid out as the rules say plus ``data`` where
jzero's layout rule puts it -- the very plan the same specs give when written out by hand
-- and trains to the single-device Optax numbers. The same through ``ZeroOptimizer(rules=)``
with logical ``param_specs`` or with the boxed parameters themselves (unboxed ones and no
specs: refused, the rules would do nothing), and an NNX model with logical ``out_sharding``.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, make_tx, reference
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jzero
from jzero.core.mesh import hybrid_mesh

VOCAB, EMBED, MLP, LENGTH, BATCH, STEPS = 26, 10, 20, 6, 8, 3
RTOL, ATOL = 1e-5, 1e-6


def tx():
    """Adam with eps = 1e-4: a few head-kernel gradients here are ~1e-6, and a smaller eps
    turns their fp32 rounding noise (the sharded step sums in another order) into ~1e-5
    relative differences in the parameters (docs/design.md, "Traps")."""
    return make_tx(eps=1e-4)


RULES = (("embed", None), ("mlp", "model"), ("vocab", "model"), ("batch", None))
# The specs RULES give each parameter, written out by hand over the mesh's other axes.
EXPLICIT = {
    "Embed_0": {"embedding": P("model", None)},  # ('vocab', 'embed')
    "Block_0": {
        "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},  # ('embed', 'mlp')
        "Dense_1": {"kernel": P("model", None), "bias": P(None)},  # ('mlp', 'embed')
    },
    "Block_1": {
        "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
        "Dense_1": {"kernel": P("model", None), "bias": P(None)},
    },
    "head": {"kernel": P(None, "model"), "bias": P("model")},  # ('embed', 'vocab')
}
# Where jzero's layout rule adds 'data' (4 devices): the first free non-leading dimension
# that 4 divides, else the largest free one, padded (EMBED = 10 -> 12); none if none is free.
SHARDED = {
    "Embed_0": {"embedding": P("model", "data")},
    "Block_0": {
        "Dense_0": {"kernel": P("data", "model"), "bias": P("model")},
        "Dense_1": {"kernel": P("model", "data"), "bias": P("data")},
    },
    "head": {"kernel": P("data", "model"), "bias": P("model")},
}
SHARDED["Block_1"] = SHARDED["Block_0"]


def dense(features, names, name=None):
    return nn.Dense(
        features,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
        bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), names[1:]),
        name=name,
    )


class Block(nn.Module):
    @nn.compact
    def __call__(self, x_BxLxE):
        h_BxLxM = nn.gelu(dense(MLP, ("embed", "mlp"))(x_BxLxE))
        return x_BxLxE + dense(EMBED, ("mlp", "embed"))(h_BxLxM)


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens_BxL):
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        x_BxLxE = nn.Embed(VOCAB, EMBED, embedding_init=init)(tokens_BxL)
        for _ in range(2):
            x_BxLxE = Block()(x_BxLxE)
        return dense(VOCAB, ("embed", "vocab"), name="head")(x_BxLxE)


def mesh_2d():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def init_fn():
    return LM().init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))


def loss_fn(params, batch):
    logits_BxLxV = LM().apply({"params": jzero.gather(params)}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["y"]).mean()


def batches():
    keys = jax.random.split(jax.random.key(1), STEPS)
    tokens = [jax.random.randint(k, (BATCH, LENGTH + 1), 0, VOCAB) for k in keys]
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in tokens]


@functools.cache
def oracle():
    return reference(tx(), nn.unbox(init_fn()["params"]), loss_fn, batches())


def train(step, state):
    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def canonical(spec):
    """``spec`` without trailing Nones, as jzero's layouts (and JAX) report it."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def assert_layout(tree, want, mesh):
    """Each leaf's spec is ``want``'s and its shard is its stored (padded) shape split over
    those axes."""
    specs = jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, P))
    assert len(specs) == len(jax.tree.leaves(tree))
    for x, spec in zip(jax.tree.leaves(tree), specs):
        assert x.sharding.spec == canonical(spec)
        split = [math.prod(mesh.shape[a] for a in jax.tree.leaves(e)) for e in spec]
        split += [1] * (x.ndim - len(split))
        assert x.addressable_data(0).shape == tuple(s // n for s, n in zip(x.shape, split))


def user_specs(plan):
    """The plan's per-parameter specs over the other axes, shaped like the parameters."""
    return jax.tree.unflatten(plan.params_def, [s.layout.user_spec for s in plan.params])


def shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn.unbox(tree))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_lm_with_rules(stage):
    mesh = mesh_2d()
    state = jzero.linen.TrainState.create(
        apply_fn=LM().apply, init_fn=init_fn, tx=tx(), mesh=mesh, stage=stage, rules=RULES
    )
    # The plan is the one the same specs give when written out by hand.
    explicit = jzero.ZeroOptimizer(tx(), mesh, stage=stage, param_specs=EXPLICIT)
    assert state.zero.plan == explicit.plan(shapes_of(init_fn()["params"]))
    assert_layout(state.zero.params, SHARDED if stage == 3 else EXPLICIT, mesh)
    mu = state.zero.opt_state[0].mu  # Adam's first moment, laid out like the parameters
    assert_layout(mu, SHARDED if stage >= 1 else EXPLICIT, mesh)
    # EMBED is padded to a multiple of the 4 'data' devices where 'data' splits it.
    embedding = (mu if stage >= 1 else state.zero.params)["Embed_0"]["embedding"]
    n = mesh.shape["data"]
    padded = -(-EMBED // n) * n if stage >= 1 else EMBED
    assert embedding.shape == (VOCAB, padded)

    state, losses = train(state.train_step(loss_fn), state)
    ref = oracle()
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(state.params, ref.params, rtol=RTOL, atol=ATOL)


def test_zero_optimizer_with_rules_and_logical_param_specs():
    mesh, variables = mesh_2d(), init_fn()
    logical = nn.get_partition_spec(variables["params"])  # ('embed', 'mlp'), ...
    assert logical["head"]["kernel"] == P("embed", "vocab")
    opt = jzero.ZeroOptimizer(tx(), mesh, stage=3, param_specs=logical, rules=RULES)
    for stage in (0, 1, 2):  # the plan, as for written-out specs, at every stage
        opt_s = jzero.ZeroOptimizer(tx(), mesh, stage=stage, param_specs=logical, rules=RULES)
        explicit = jzero.ZeroOptimizer(tx(), mesh, stage=stage, param_specs=EXPLICIT)
        assert opt_s.plan(shapes_of(variables["params"])) == explicit.plan(
            shapes_of(variables["params"])
        )
    state = opt.init(nn.unbox(variables["params"]))
    assert_layout(state.params, SHARDED, mesh)
    state, losses = train(opt.train_step(loss_fn), state)
    ref = oracle()
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(opt.full_params(state), ref.params, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_optimizer_reads_boxed_params_with_rules(stage):
    """rules= and no param_specs=: ZeroOptimizer maps the params' own
    nn.with_logical_partitioning metadata (boxed, as model.init returns them)."""
    mesh, boxed = mesh_2d(), init_fn()["params"]
    opt = jzero.ZeroOptimizer(tx(), mesh, stage=stage, rules=RULES)
    explicit = jzero.ZeroOptimizer(tx(), mesh, stage=stage, param_specs=EXPLICIT)
    want = user_specs(explicit.plan(shapes_of(boxed)))
    assert jax.tree.leaves(user_specs(opt.plan(boxed))) == jax.tree.leaves(want)
    state = opt.init(boxed)  # the boxes ride along in the state's tree
    assert isinstance(state.params["head"]["kernel"], nn.LogicallyPartitioned)
    assert_layout(state.params, SHARDED if stage == 3 else EXPLICIT, mesh)
    assert_layout(state.opt_state[0].mu, SHARDED, mesh)
    from_init_fn = opt.init(init_fn=lambda: init_fn()["params"])  # abstract boxes, same plan
    assert from_init_fn.plan == state.plan

    state, losses = train(opt.train_step(loss_fn), state)
    ref = oracle()
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(nn.unbox(opt.full_params(state)), ref.params, rtol=RTOL, atol=ATOL)


def test_zero_optimizer_reads_nnx_variables_with_rules():
    mesh = mesh_2d()
    params = nnx.state(make_nnx(), nnx.Param)  # Variables carrying out_sharding
    plan = jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3, rules=RULES).plan(params)
    got = jax.tree.leaves(user_specs(plan), is_leaf=lambda x: isinstance(x, P))
    # leaves in order: down.kernel, embed.embedding, head.kernel, up.bias, up.kernel
    assert got == [P("model"), P("model"), P(None, "model"), P("model"), P(None, "model")]


def test_rules_with_nothing_to_map_are_refused():
    """Unboxed params, rules= and no param_specs=: the rules would do nothing, silently
    replicating every leaf over 'model'; the error says how to give them names."""
    mesh, params = mesh_2d(), nn.unbox(init_fn()["params"])
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3, rules=RULES)
    fixes = r"rules= maps logical axis names .* no Flax partitioning metadata .* would change "
    fixes += r"nothing\. Pass the boxed parameters .*"
    fixes += r"nn\.get_partition_spec\(variables\['params'\]\)"
    fixes += r".*jzero\.linen\.TrainState\.create\(\.\.\., rules=\)"
    with pytest.raises(ValueError, match=fixes):
        opt.init(params)
    with pytest.raises(ValueError, match=fixes):
        opt.plan(shapes_of(params))
    # Without rules= the same params are placed over 'data' alone, as documented.
    plain = jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3).plan(shapes_of(params))
    assert set(jax.tree.leaves(user_specs(plain))) == {P()}


def test_which_rules_apply():
    mesh, params = mesh_2d(), init_fn()["params"]
    logical, shapes = nn.get_partition_spec(params), shapes_of(params)
    sgd = optax.sgd(0.1)
    canonical_specs = user_specs(
        jzero.ZeroOptimizer(sgd, mesh, stage=3, param_specs=EXPLICIT).plan(shapes)
    )
    specs = lambda **kw: user_specs(jzero.ZeroOptimizer(sgd, mesh, stage=3, **kw).plan(shapes))
    linen = lambda **kw: user_specs(
        jzero.linen.TrainState.create(
            apply_fn=LM().apply, variables=init_fn(), tx=sgd, mesh=mesh, stage=3, **kw
        ).zero.plan
    )
    # The nn.logical_axis_rules context is read when rules= is not given; rules= wins.
    with nn.logical_axis_rules(RULES):
        assert linen() == canonical_specs
    with nn.logical_axis_rules((("mlp", None), ("vocab", None))):
        assert linen(rules=RULES) == canonical_specs
    # A variable's own rules (with_logical_partitioning(..., rules=)) come before rules=.
    own = nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp"), rules=(("embed", "model"),)
    )
    dense = nn.Dense(MLP, kernel_init=own, use_bias=False)
    state = jzero.linen.TrainState.create(
        apply_fn=dense.apply,
        variables=dense.init(jax.random.key(0), jnp.zeros((1, EMBED))),
        tx=sgd, mesh=mesh, stage=3, rules=RULES,
    )  # fmt: skip
    assert user_specs(state.zero.plan)["kernel"] == P("model")
    # A logical name with no rule is replicated (Flax's behaviour): 'mlp' here.
    got = specs(param_specs=logical, rules=(("vocab", "model"),))
    assert got["Block_0"]["Dense_0"] == {"kernel": P(), "bias": P()}
    assert got["head"] == {"kernel": P(None, "model"), "bias": P("model")}
    # Flax's precedence: each mesh axis once per array, the earlier rule first.
    got = specs(param_specs=logical, rules=(("mlp", "model"), ("embed", "model")))
    assert got["Block_0"]["Dense_0"]["kernel"] == P(None, "model")
    assert got["Embed_0"]["embedding"] == P(None, "model")
    # A rule to jzero's own 'data' axis gives that dimension back to jzero's layout rule.
    assert specs(param_specs=logical, rules=(("embed", "data"),) + RULES) == canonical_specs
    # ... and one to 'replica' (hybrid sharding): model states are replicated across it.
    opt = jzero.ZeroOptimizer(
        sgd, hybrid_mesh(2), stage=3, param_specs=logical, rules=(("vocab", ("replica",)),)
    )
    assert set(jax.tree.leaves(user_specs(opt.plan(shapes)))) == {P()}


# ---------------------------------------------------------------------------- NNX
class NNXLM(nnx.Module):
    def __init__(self, rngs):
        part = lambda init, names: nnx.with_partitioning(init, names)
        self.embed = nnx.Embed(
            VOCAB, EMBED, embedding_init=part(nnx.initializers.normal(1.0), ("vocab", "embed")),
            rngs=rngs,
        )  # fmt: skip
        self.up = nnx.Linear(
            EMBED, MLP, kernel_init=part(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=part(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs,
        )  # fmt: skip
        self.down = nnx.Linear(
            MLP, EMBED, kernel_init=part(nnx.initializers.lecun_normal(), ("mlp", "embed")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.head = nnx.Linear(
            EMBED, VOCAB, kernel_init=part(nnx.initializers.lecun_normal(), ("embed", "vocab")),
            use_bias=False, rngs=rngs,
        )  # fmt: skip

    def __call__(self, tokens_BxL):
        x_BxLxE = self.embed(tokens_BxL)
        x_BxLxE = x_BxLxE + self.down(nnx.gelu(self.up(x_BxLxE)))
        return self.head(x_BxLxE)


def make_nnx():
    with nnx.use_eager_sharding(False):
        return NNXLM(nnx.Rngs(0))


def nnx_loss(model, batch):
    logits_BxLxV = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["y"]).mean()


def test_nnx_lm_with_rules():
    mesh = mesh_2d()
    state = jzero.nnx.TrainState.create(make_nnx(), tx=tx(), mesh=mesh, stage=3, rules=RULES)
    want = {  # RULES' specs plus 'data' (EMBED = 10 padded to 12, 3 per device)
        "embed": {"embedding": P("model", "data")},  # ('vocab', 'embed')
        "up": {"kernel": P("data", "model"), "bias": P("model")},  # ('embed', 'mlp')
        "down": {"kernel": P("model", "data")},  # ('mlp', 'embed')
        "head": {"kernel": P("data", "model")},  # ('embed', 'vocab')
    }
    assert_layout(state.zero.params, want, mesh)
    n = mesh.shape["data"]
    assert state.zero.params["embed"]["embedding"].shape == (VOCAB, -(-EMBED // n) * n)
    explicit = {  # the same, written out over the other axes
        "embed": {"embedding": P("model")},
        "up": {"kernel": P(None, "model"), "bias": P("model")},
        "down": {"kernel": P("model")},
        "head": {"kernel": P(None, "model")},
    }
    pure = nnx.to_pure_dict(nnx.state(make_nnx(), nnx.Param))
    opt = jzero.ZeroOptimizer(tx(), mesh, stage=3, param_specs=explicit)
    assert state.zero.plan == opt.plan(pure)

    graphdef, ref_params, rest = nnx.split(make_nnx(), nnx.Param, ...)
    loss = lambda p, b: nnx_loss(nnx.merge(graphdef, p, rest), b)
    ref = reference(tx(), ref_params, loss, batches())
    state, losses = train(state.train_step(nnx_loss), state)
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(nnx.split(state.model(), nnx.Param, ...)[1], ref.params, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- errors
def test_errors():
    mesh, variables = mesh_2d(), init_fn()
    logical = nn.get_partition_spec(variables["params"])
    create = lambda **kw: jzero.linen.TrainState.create(
        apply_fn=LM().apply, variables=variables, tx=optax.sgd(0.1), mesh=mesh, stage=3, **kw
    )
    # A rule naming an axis the mesh lacks: the rule and the mesh's axes.
    missing = r"rules entry \('mlp', 'tensor'\) maps 'mlp' to mesh axis 'tensor', but the mesh "
    missing += r"has axes \{'data': 4, 'model': 2\}"
    with pytest.raises(ValueError, match=missing):
        jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3, rules=(("mlp", "tensor"),))
    with pytest.raises(ValueError, match=missing):
        create(rules=(("mlp", "tensor"),))
    with pytest.raises(ValueError, match=missing):
        jzero.nnx.TrainState.create(
            make_nnx(), tx=optax.sgd(0.1), mesh=mesh, stage=3, rules=(("mlp", "tensor"),)
        )
    with pytest.raises(TypeError, match=r"rules entry 'mlp' is not a \(logical_name, mesh_axes"):
        create(rules=("mlp", "model"))
    # Logical names and no rules: the error says to pass rules=.
    with pytest.raises(
        ValueError,
        match=r"param \['Block_0'\]\['Dense_0'\]\['bias'\] has logical axis names \('mlp',\).*"
        r"pass rules= to TrainState.create, e.g. rules=\(\('mlp', None\),\)",
    ):
        create()
    hint = r"If '(\w+)' is a logical axis name .* map it to mesh axes with rules=, e.g. "
    hint += r"rules=\(\('\1', 'model'\), ...\)"
    with pytest.raises(ValueError, match=r"param \['Block_0'\]\['Dense_0'\]\['bias'\].*" + hint):
        jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3, param_specs=logical).plan(
            shapes_of(variables["params"])
        )
    with pytest.raises(ValueError, match=r"param \['down'\]\['kernel'\].*" + hint):
        jzero.nnx.TrainState.create(make_nnx(), tx=optax.sgd(0.1), mesh=mesh, stage=3)
    # NNX keeps a name with no rule as it is (NNX's behaviour): it must be a mesh axis.
    with pytest.raises(ValueError, match=r"param \['down'\]\['kernel'\].*If 'embed' is a logical"):
        jzero.nnx.TrainState.create(
            make_nnx(), tx=optax.sgd(0.1), mesh=mesh, stage=3, rules=RULES[1:]
        )
