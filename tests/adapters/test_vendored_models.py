"""Two third-party Flax Linen models, vendored unchanged (``tests/vendor``), reach per-layer
stage 3 as they are (the default step gathers each weight at its use), or with
``jzero.linen.TrainState.create(..., stage=3, layers=Block)`` recomputing each block.

Without ``layers=``, ``StepOptions(remat_policy=jax.checkpoint_policies.nothing_saveable)``
recomputes each block as ``layers=`` does (the blocks are found from the parameter names,
``encoderdecoderblock_0`` ..., ``blocks_0`` ...), reaching the same compiled temp:
``layers=`` is an optional hint.

Flax's lm1b ``TransformerLM`` (block ``EncoderDecoder1DBlock``) and nanodo's
``TransformerDo`` (block ``TBlock``), at tiny sizes, with no dropout. Every stage matches
single-device Optax; in stage 3 each block kernel is all-gathered twice per step (forward,
then backward again) and the compiled temp memory drops by at least the gathered
parameters of all blocks but one.

Two things the models need from the caller, neither of them an edit to the model:

- lm1b annotates its parameters with *logical* names (``'embed'``, ``'mlp'``, ``'vocab'``,
  ...); ``rules=()`` maps none of them to a mesh axis (Flax's rule: a name without a rule
  is replicated), so every leaf is laid out over 'data' alone.
- nanodo's default ``fsdp_enabled=True`` boxes its attention kernels with
  ``nn.with_partitioning``; Flax's ``DenseGeneral`` then applies a 3-D sharding constraint
  to its 2-D flattened kernel whenever a mesh is in context (google/flax#3676), as it is
  inside jzero's ``shard_map`` (and under a plain ``jax.set_mesh``). jzero chooses its own
  shard dimensions and drops 'data' from the specs anyway, so ``fsdp_enabled=False``
  (nanodo's own switch) loses nothing.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_text import all_gathers
from _models import assert_tree_close, make_tx, reference
from vendor.flax_lm1b import models as lm1b
from vendor.nanodo import model as nanodo

import jzero

VOCAB, D, HEADS, MLP, LAYERS, SEQ, BATCH, STEPS, LR = 128, 64, 4, 256, 3, 16, 16, 3, 1e-3
# Adam eps above the gradients' fp32 rounding noise (sums in another order on 8 devices),
# so that Adam does not turn that noise into +-lr updates (docs/design.md, "Traps"): e.g.
# the embedding rows of tokens missing from a batch get gradients that are zero up to it.
EPS = 1e-4


class Case(NamedTuple):
    """One vendored model at a tiny size, and what jzero is told about it."""

    model: nn.Module
    block: type[nn.Module]  # the model's own block class: layers=block
    loss_fn: Callable[..., jax.Array]  # (params, batch) -> mean next-token cross-entropy
    blocks: Callable[[Any], list[Any]]  # params -> each block's parameter subtree
    create_kwargs: dict[str, Any]  # anything else TrainState.create needs


def xent(logits_BxLxV: jax.Array, y_BxL: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, y_BxL).mean()


def lm1b_case() -> Case:
    cfg = lm1b.TransformerConfig(
        vocab_size=VOCAB,
        output_vocab_size=VOCAB,
        emb_dim=D,
        num_heads=HEADS,
        num_layers=LAYERS,
        qkv_dim=D,
        mlp_dim=MLP,
        max_len=SEQ,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        deterministic=True,
    )
    model = lm1b.TransformerLM(cfg)
    # TransformerLM shifts its inputs right itself: logits at t predict token t.
    loss_fn = lambda params, batch: xent(model.apply({"params": params}, batch), batch)
    return Case(
        model,
        lm1b.EncoderDecoder1DBlock,
        loss_fn,
        lambda p: [p["decoder"][f"encoderdecoderblock_{i}"] for i in range(LAYERS)],
        {"rules": ()},
    )


def nanodo_case() -> Case:
    cfg = nanodo.DoConfig(D=D, H=HEADS, L=SEQ, N=LAYERS, V=VOCAB, F=MLP, fsdp_enabled=False)
    model = nanodo.TransformerDo(cfg)
    # Logits at t predict token t + 1.
    loss_fn = lambda params, batch: xent(
        model.apply({"params": params}, batch)[:, :-1], batch[:, 1:]
    )
    return Case(
        model, nanodo.TBlock, loss_fn, lambda p: [p[f"blocks_{i}"] for i in range(LAYERS)], {}
    )


CASES = {"lm1b": lm1b_case, "nanodo": nanodo_case}


def init(model: nn.Module) -> dict[str, Any]:
    return model.init(jax.random.key(0), jnp.ones((BATCH, SEQ), jnp.int32))


def make_batches(n: int) -> list[jax.Array]:
    """Token batches ``int32[BATCH, SEQ]`` in ``[1, VOCAB)`` (lm1b masks token 0 as padding)."""
    keys = jax.random.split(jax.random.key(5), n)
    return [jax.random.randint(k, (BATCH, SEQ), 1, VOCAB) for k in keys]


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


def make_state(name: str, stage: int, **kwargs: Any) -> jzero.linen.TrainState:
    c = case(name)
    return jzero.linen.TrainState.create(
        apply_fn=c.model.apply,
        init_fn=functools.partial(init, c.model),  # under jit: sharded from the start
        tx=make_tx(LR, eps=EPS),
        mesh=jzero.data_mesh(),
        stage=stage,
        **c.create_kwargs,
        **kwargs,
    )


@functools.cache
def oracle(name: str):
    c = case(name)
    params = nn.unbox(init(c.model)["params"])
    return reference(make_tx(LR, eps=EPS), params, c.loss_fn, make_batches(STEPS))


def compiled_stage3(name: str, **kwargs: Any):
    state = make_state(name, 3, **kwargs)
    return state.train_step(case(name).loss_fn).lower(state, make_batches(1)[0]).compile()


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def assert_matches_oracle(name: str, state, step) -> None:
    ref = oracle(name)
    losses = []
    for batch in make_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5, atol=1e-6)
    assert_tree_close(state.params, ref.params, rtol=1e-5, atol=1e-6)


# Stages 2-3, where layers= gathers each block (at 0-1 the parameters are whole and the
# step is the stage parity tests').
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_layers_matches_single_device_optax(name, stage):
    state = make_state(name, stage, layers=case(name).block)
    assert_matches_oracle(name, state, state.train_step(case(name).loss_fn))


@pytest.mark.parametrize("name", sorted(CASES))
def test_stage3_without_layers_matches_single_device_optax(name):
    # The default step: each weight gathered at its use (and again in backward).
    state = make_state(name, 3)
    assert_matches_oracle(name, state, state.train_step(case(name).loss_fn))


def compiled_whole_gather(name: str):
    """The stage-3 step that gathers the whole model once, up front (the baseline)."""
    state = make_state(name, 3)
    loss = lambda params, batch: case(name).loss_fn(jzero.gather(params), batch)
    step = state.train_step(loss, manual_gather=True)
    return step.lower(state, make_batches(1)[0]).compile()


# Each model one way (CI's time): lm1b's blocks found by layers=, nanodo's gathered at use.
@pytest.mark.parametrize(("name", "layers"), [("lm1b", True), ("nanodo", False)])
def test_stage3_gathers_each_block_twice_and_holds_one(name, layers):
    # With layers=Block each block is a remat_layer (recomputed in backward); without,
    # the default step gathers each weight at its use, again in backward, activations kept.
    c = case(name)
    params = nn.unbox(jax.eval_shape(functools.partial(init, c.model))["params"])
    blocks = c.blocks(params)
    in_blocks = collections.Counter(x.shape for x in jax.tree.leaves(blocks) if x.ndim >= 2)
    everywhere = collections.Counter(x.shape for x in jax.tree.leaves(params) if x.ndim >= 2)
    per_layer = compiled_stage3(name, **({"layers": c.block} if layers else {}))
    whole = compiled_whole_gather(name)
    for shape, n in everywhere.items():  # kernels: in a block forward + backward
        assert all_gathers(per_layer, shape) >= n + in_blocks[shape], shape
        assert all_gathers(whole, shape) == n, shape
    for shape in in_blocks:  # nothing else has a block kernel's shape in these models
        assert all_gathers(per_layer, shape) == 2 * everywhere[shape], shape
    temp = per_layer.memory_analysis().temp_size_in_bytes
    temp_whole = whole.memory_analysis().temp_size_in_bytes
    block_bytes = max(map(nbytes, blocks))
    print(
        f"{name} stage-3 temp: {'layers=' if layers else 'default'} {temp} B, whole-model "
        f"gather {temp_whole} B; params {nbytes(params)} B, one block {block_bytes} B"
    )
    # With layers= no more than one block's parameters are gathered at a time: the gathered
    # parameters of the other LAYERS - 1 blocks are saved at least, and the step (every
    # block recomputed in backward) holds less than the whole model. The default step
    # keeps the blocks' activations on top, and how many gathered weights it holds at once
    # is XLA's schedule: on XLA 0.10 it saved LAYERS - 1 blocks too; XLA:CPU 0.11+ holds
    # more on nanodo (temp 1,094,176 B against 810,464 B on 0.10 and 1,270,496 B for the
    # whole-model gather; lm1b as before): it still holds less than the whole gather.
    if layers:
        assert temp_whole - temp >= (LAYERS - 1) * block_bytes, (temp, temp_whole, block_bytes)
        assert temp < nbytes(params), (temp, nbytes(params))
    else:
        assert temp < temp_whole, (temp, temp_whole)


RECOMPUTE = jzero.StepOptions(remat_policy=jax.checkpoint_policies.nothing_saveable)


@pytest.mark.parametrize("name", ["nanodo"])  # one model (CI time); lm1b: the same rule
def test_remat_policy_without_layers_reaches_the_layers_temp(name):
    # The blocks found from the parameter names, each recomputed: no more temp than
    # layers=Block (which names the class), far less than keeping every activation.
    state = make_state(name, 3)
    batch = make_batches(1)[0]
    recomputing = state.train_step(case(name).loss_fn, RECOMPUTE).lower(state, batch).compile()
    temp = recomputing.memory_analysis().temp_size_in_bytes
    with_layers = compiled_stage3(name, layers=case(name).block).memory_analysis()
    keeping = compiled_stage3(name).memory_analysis().temp_size_in_bytes
    print(
        f"{name} stage-3 temp: remat_policy without layers= {temp} B, layers= "
        f"{with_layers.temp_size_in_bytes} B, default (activations kept) {keeping} B"
    )
    # layers= cuts at the block's call, found layers where the fewest bytes cross (the
    # residual stream): XLA may keep that boundary's input and output, two residual
    # activations (BATCH/N x SEQ x D fp32 each; lm1b on jax 0.12: 1,216 B more)
    residual = 4 * (BATCH // 8) * SEQ * D
    assert temp <= with_layers.temp_size_in_bytes + 2 * residual, (temp, with_layers)
    assert temp < keeping


@pytest.mark.parametrize("name", sorted(CASES))
def test_remat_policy_without_layers_matches_single_device_optax(name):
    state = make_state(name, 3)
    assert_matches_oracle(name, state, state.train_step(case(name).loss_fn, RECOMPUTE))
