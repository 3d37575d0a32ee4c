"""Finding an unrolled model's repeated layers from its parameters (``core/gather/layers.py``)
and the spans of the loss they are recomputed in under ``StepOptions(remat_policy=...)``,
at the seams: buckets, hpZ, gradient accumulation, a parameter shared by every layer.
What the recomputation saves is measured on models big enough to show it
(``test_unrolled_stage3.py``, ``test_vendored_models.py``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import assert_each_step_is_optax, record, regression_batches

import jzero
from jzero.accounting import dot_flops
from jzero.core.gather.layers import layer_gaps, layer_of


def paths_of(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [p for p, _ in leaves], [tuple(x.shape) for _, x in leaves]


def z(*shape):
    return jnp.zeros(shape)


def test_numbered_siblings_with_equal_subtrees_are_layers():
    linen = {"Embed_0": {"e": z(9, 4)}, "blocks_0": {"w": z(4, 4)}, "blocks_1": {"w": z(4, 4)}}
    assert layer_of(*paths_of(linen)) == [None, 0, 1]
    listed = {"head": z(4, 2), "layers": [{"a": z(4, 8), "b": z(8, 4)}] * 3}
    assert layer_of(*paths_of(listed)) == [None, 0, 0, 1, 1, 2, 2]


def test_the_group_covering_most_leaves_wins_over_nested_repeats():
    block = {"LayerNorm_0": {"s": z(4)}, "LayerNorm_1": {"s": z(4)}, "Dense_0": {"k": z(4, 8)}}
    model = {"block_0": block, "block_1": block}
    assert layer_of(*paths_of(model)) == [0, 0, 0, 1, 1, 1]


def test_siblings_of_other_shapes_are_not_layers():
    # Dense_0 (4x8) and Dense_1 (8x4) are numbered alike but are not repeats of one layer.
    assert layer_of(*paths_of({"Dense_0": {"k": z(4, 8)}, "Dense_1": {"k": z(8, 4)}})) == [
        None,
        None,
    ]


def test_gaps_between_layers_read_in_turn():
    layers = [None, 0, 0, 1, 1]  # embed, then two layers of two leaves
    reads = {0: [3], 1: [5], 2: [7], 3: [9], 4: [12], -1: [0]}
    assert layer_gaps(layers, reads, 20) == [(4, 5), (8, 9), (13, 20)]


def test_no_gaps_when_layers_interleave_or_a_parameter_is_read_between_them():
    assert layer_gaps([0, 1], {0: [3, 9], 1: [5]}, 20) == []  # layer 0 read after layer 1
    assert layer_gaps([0, 1, None], {0: [3], 1: [9], 2: [6]}, 20) == []  # shared, between
    assert layer_gaps([0, 1], {0: [3]}, 20) == []  # layer 1 never read


D, H, L, B = 16, 32, 4, 16
RECOMPUTE = jax.checkpoint_policies.nothing_saveable


def params():
    keys = jax.random.split(jax.random.key(1), 2 * L)
    return {
        "layers": [
            {
                "w1": jax.random.normal(keys[2 * i], (D, H)) / 4,
                "w2": jax.random.normal(keys[2 * i + 1], (H, D)) / 6,
            }
            for i in range(L)
        ],
        "shared": jnp.ones((D,)),
        "scales": jnp.linspace(0.5, 1.5, L * D).reshape(L, D),
    }


def loss(p, batch):
    x = batch["x"]
    for layer in p["layers"]:
        x = x + jnp.tanh(x @ layer["w1"]) @ layer["w2"]
    return jnp.mean((x * p["shared"] - batch["y"]) ** 2)


def derived_up_front(p, batch):  # every parameter transposed and reshaped before the layers
    p = jax.tree.map(lambda w: w.T.reshape(w.T.shape[::-1]).reshape(w.T.shape).T, p)
    return loss(p, batch)


def stack_indexed_in_layers(p, batch):  # a stacked leaf indexed inside every layer
    x = batch["x"]
    for i, layer in enumerate(p["layers"]):
        x = x * p["scales"][i] + jnp.tanh(x @ layer["w1"]) @ layer["w2"]
    return jnp.mean((x - batch["y"]) ** 2)


def shared_in_every_layer(p, batch):  # a parameter read by every layer: no spans
    x = batch["x"]
    for layer in p["layers"]:
        x = x * p["shared"] + jnp.tanh(x @ layer["w1"]) @ layer["w2"]
    return jnp.mean((x - batch["y"]) ** 2)


SEAMS = {
    "plain": ({}, {}),
    "bucket": ({"comm": jzero.Communication(bucket=True)}, {}),
    "hpz": ({"comm": jzero.Communication(hpz=2)}, {}),
    "grad_accum": ({}, {"grad_accum": 2}),
    "shared_in_every_layer": ({}, {}),
    "checkpointed_layers": ({}, {}),
    "derived_up_front": ({}, {}),
    "stack_indexed_in_layers": ({}, {}),
}
NOTHING_FOUND = {"shared_in_every_layer", "stack_indexed_in_layers"}  # warned: policy unused


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_recomputed_layers_match_single_device_optax(seam):
    opt_kw, step_kw = SEAMS[seam]
    fn = {
        "shared_in_every_layer": shared_in_every_layer,
        "checkpointed_layers": checkpointed_layers,
        "derived_up_front": derived_up_front,
        "stack_indexed_in_layers": stack_indexed_in_layers,
    }.get(seam, loss)
    tx = optax.adam(1e-2, eps=1e-4)
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=3, min_shard_size=1, **opt_kw)
    state = opt.init(params())
    step = opt.train_step(fn, jzero.StepOptions(remat_policy=RECOMPUTE, **step_kw))
    batches = regression_batches(3, B, D)

    def one(state, batch):
        state, metrics = step(state, batch)
        return state, metrics["loss"]

    whole = lambda state: (opt.full_params(state), opt.full_state(state).opt_state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trajectory = record(one, state, whole, batches)
    unused = [w for w in caught if "has no layer to act on" in str(w.message)]
    assert len(unused) == (seam in NOTHING_FOUND), [str(w.message) for w in caught]
    assert_each_step_is_optax(tx, fn, trajectory, batches)


def checkpointed_layers(p, batch):  # the model's own layers: checkpoints keeping everything
    block = jax.checkpoint(
        lambda layer, x: x + jnp.tanh(x @ layer["w1"]) @ layer["w2"],
        policy=jax.checkpoint_policies.everything_saveable,
    )
    x = batch["x"]
    for layer in p["layers"]:
        x = block(layer, x)
    return jnp.mean((x * p["shared"] - batch["y"]) ** 2)


def test_layers_of_the_models_own_are_not_wrapped_again():
    # Each jax.checkpoint is its own remat_layer already, with its own policy (here: keep
    # everything, recompute nothing); a found layer around it would recompute it with the
    # step's policy instead. The step's policy changes nothing here.
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3, min_shard_size=1)
    state, batch = opt.init(params()), regression_batches(1, B, D)[0]
    hlo = lambda options: (
        opt.train_step(checkpointed_layers, options).lower(state, batch).compile().as_text()
    )
    assert dot_flops(hlo(jzero.StepOptions(remat_policy=RECOMPUTE))) == dot_flops(
        hlo(jzero.StepOptions())
    )


def cast_up_front(p, batch):  # mixed precision by hand: every parameter cast to bf16
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    return loss(p, {**batch, "x": batch["x"].astype(jnp.bfloat16)})


@pytest.mark.parametrize("fn", [cast_up_front, derived_up_front])
def test_parameters_derived_up_front_are_recomputed_where_the_layers_use_them(fn):
    # The casts and reshapes at the top of the loss are no layer's reads: each is derived
    # again inside the layer that uses it. Recomputing then holds at most one layer's
    # gathered weights more than keeping (a layer gathers its weights together, the
    # default one weight at a time); taking the casts for the layers' reads held all.
    big = {"layers": [{"w1": jnp.ones((256, 1024)), "w2": jnp.ones((1024, 256))}] * 8}
    big["shared"], big["scales"] = jnp.ones((256,)), jnp.ones((8, 256))
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3, min_shard_size=1)
    state, batch = opt.init(big), regression_batches(1, 16, 256)[0]
    temp = lambda options: (
        (
            opt.train_step(fn, options).lower(state, batch).compile().memory_analysis()
        ).temp_size_in_bytes
    )
    kept, recomputed = temp(jzero.StepOptions()), temp(jzero.StepOptions(remat_policy=RECOMPUTE))
    layer = sum(w.nbytes for w in jax.tree.leaves(big["layers"][0]))
    assert recomputed <= kept + layer, (recomputed, kept, layer)
