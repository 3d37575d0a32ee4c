"""A small GPT-style decoder LM in Flax Linen, written for jzero stage 3.

Token + learned position embedding, ``n_layers`` pre-LN blocks (causal multi-head
self-attention, GELU MLP), a final LayerNorm and an output head tied to the token
embedding (or untied). The blocks are stacked with ``nn.scan`` over one ``Block`` whose
parameters carry a leading ``n_layers`` axis, and rematerialised with ``nn.remat``.

Per-layer gathering: every parametrised submodule is wrapped in
``nn.map_variables(..., trans_in_fn=jzero.gather)``. Under
``ZeroOptimizer.train_step(loss_fn, manual_gather=True)`` the parameter tree handed to
``model.apply`` holds ``jzero.Sharded`` handles (stages 2/3); ``nn.scan`` slices their
arrays one layer at a time, and the map inside ``nn.remat`` gathers that layer only, so
stage 3 holds about one layer's gathered parameters at a time in forward, and gathers it
again in backward. With plain arrays ``jzero.gather`` is the identity: the same loss
function runs single-device, and in every stage.

Tensor names carry their shapes: B batch, T time, D d_model, H heads, K head dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jzero


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    dtype: Any = jnp.float32
    tied_head: bool = True  # output head = token embedding transposed
    unrolled: bool = False  # blocks as n_layers modules in a Python loop, not one nn.scan
    gather_mesh: Any = None  # jzero.gather(..., mesh=): stage 3 in your own jit step


def gathered(module_cls: type[nn.Module], parent: nn.Module) -> Any:
    """``module_cls`` whose ``'params'`` pass through :func:`jzero.gather` before use (with
    the config's ``gather_mesh``: whole on it, for stage 3 in a user's own jit step)."""
    gather = functools.partial(jzero.gather, mesh=parent.cfg.gather_mesh)
    return nn.map_variables(
        module_cls,
        "params",
        trans_in_fn=gather,
        init=parent.is_initializing(),  # init: create plain params, nothing to gather
    )


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        cfg = self.cfg
        B, T, D = x_BxTxD.shape
        H, K = cfg.n_heads, D // cfg.n_heads
        dense = lambda features, name: nn.Dense(
            features, dtype=cfg.dtype, kernel_init=nn.initializers.normal(0.02), name=name
        )

        h_BxTxD = nn.LayerNorm(dtype=cfg.dtype, name="ln_attn")(x_BxTxD)
        qkv_BxTx3D = dense(3 * D, "qkv")(h_BxTxD)
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = jnp.split(qkv_BxTx3D.reshape(B, T, 3 * H, K), 3, axis=2)
        scores_BxHxTxT = jnp.einsum("bqhk,bthk->bhqt", q_BxTxHxK, k_BxTxHxK) / (K**0.5)
        causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores_BxHxTxT = jnp.where(causal_TxT, scores_BxHxTxT, jnp.finfo(cfg.dtype).min)
        probs_BxHxTxT = jax.nn.softmax(scores_BxHxTxT, axis=-1)
        attn_BxTxHxK = jnp.einsum("bhqt,bthk->bqhk", probs_BxHxTxT, v_BxTxHxK)
        x_BxTxD = x_BxTxD + dense(D, "attn_out")(attn_BxTxHxK.reshape(B, T, D))

        h_BxTxD = nn.LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x_BxTxD)
        h_BxTxF = nn.gelu(dense(cfg.mlp_ratio * D, "mlp_in")(h_BxTxD))
        x_BxTxD = x_BxTxD + dense(D, "mlp_out")(h_BxTxF)
        return x_BxTxD, None


class Table(nn.Module):
    """An embedding table, returned whole: wrapped in :func:`gathered`, it is gathered once
    per forward pass even when used twice (token lookup and the tied output head)."""

    num_embeddings: int
    features: int

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.normal(0.02)
        return self.param("embedding", init, (self.num_embeddings, self.features))


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        cfg = self.cfg
        T = tokens_BxT.shape[1]
        tok_VxD = gathered(Table, self)(cfg.vocab_size, cfg.d_model, name="tok_embed")()
        pos_TxD = gathered(Table, self)(cfg.seq_len, cfg.d_model, name="pos_embed")()[:T]
        x_BxTxD = (jnp.take(tok_VxD, tokens_BxT, axis=0) + pos_TxD).astype(cfg.dtype)

        if cfg.unrolled:  # each block its own parameters (2-D kernels), gathered in remat
            for i in range(cfg.n_layers):
                x_BxTxD, _ = nn.remat(gathered(Block, self))(cfg, name=f"block_{i}")(x_BxTxD)
        else:  # gather inside remat (backward gathers again), remat inside scan (a layer at a time)
            Blocks = nn.scan(
                nn.remat(gathered(Block, self)),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.n_layers,
            )
            x_BxTxD, _ = Blocks(cfg, name="blocks")(x_BxTxD, None)

        x_BxTxD = gathered(nn.LayerNorm, self)(dtype=cfg.dtype, name="ln_final")(x_BxTxD)
        if cfg.tied_head:
            return jnp.einsum("btd,vd->btv", x_BxTxD, tok_VxD.astype(cfg.dtype))
        head = gathered(nn.Dense, self)(cfg.vocab_size, dtype=cfg.dtype, name="head")
        return head(x_BxTxD)


def init_params(cfg: GPTConfig, key: jax.Array) -> Any:
    """Fresh parameters; traceable, so it works under ``jax.eval_shape`` and ``jit``."""
    tokens_1xT = jnp.zeros((1, cfg.seq_len), jnp.int32)
    return GPT(cfg).init(key, tokens_1xT)["params"]


def logits_fn(cfg: GPTConfig, params: Any, tokens_BxT: jax.Array) -> jax.Array:
    """Next-token logits ``float[B, T, vocab]`` (params: full arrays, or Sharded handles)."""
    return GPT(cfg).apply({"params": params}, tokens_BxT)


def make_loss_fn(cfg: GPTConfig):
    """``loss_fn(params, batch)``: mean next-token cross-entropy; batch = {"tokens": [B, T+1]}."""

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        tokens_BxTp1 = batch["tokens"]
        logits_BxTxV = logits_fn(cfg, params, tokens_BxTp1[:, :-1])
        labels_BxT = tokens_BxTp1[:, 1:]
        losses_BxT = optax.softmax_cross_entropy_with_integer_labels(
            logits_BxTxV.astype(jnp.float32), labels_BxT
        )
        return jnp.mean(losses_BxT)

    return loss_fn


def muon(
    params: Any, learning_rate: float = 0.02, *, adam_learning_rate: float = 3e-4,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:  # fmt: skip
    """Muon as its authors train GPTs: Newton-Schulz on the blocks' weight matrices (the
    scanned blocks' kernels with their leading layer axis as a batch axis), AdamW on the
    embeddings, the head, biases and LayerNorms (Jordan et al. 2024; Liu et al. 2025)."""
    stack = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    matrix = optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    def dims(path: tuple, x: Any) -> Any:
        names = [str(getattr(k, "key", k)) for k in path]
        in_block = names[0] == "blocks" or names[0].startswith("block_")
        if not in_block or names[-1] != "kernel":
            return None
        return stack if x.ndim == 3 else matrix

    return optax.contrib.muon(
        learning_rate,
        adam_learning_rate=adam_learning_rate,
        weight_decay=weight_decay,
        adam_weight_decay=weight_decay,
        muon_weight_dimension_numbers=jax.tree_util.tree_map_with_path(dims, params),
    )


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def problem(
    *, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 64,
    batch: int = 64, lr: float = 3e-4,
) -> dict[str, Any]:  # fmt: skip
    """The GPT's training step as :func:`jzero.autoconfigure` takes it (and ``python -m jzero
    autoconfigure examples/gpt.py:problem --set d_model=256``): its loss, parameters (made
    under ``jit``, never whole on one device), a global batch of ``batch`` sequences,
    AdamW, and the one option the loss needs (it gathers per layer: ``manual_gather``)."""
    cfg = GPTConfig(seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
    return {
        "loss_fn": make_loss_fn(cfg),
        "init_fn": functools.partial(init_params, cfg, jax.random.key(0)),
        "batch": {"tokens": jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)},
        "tx": optax.adamw(lr, weight_decay=0.1),
        "config": jzero.ZeroConfig(stage=0, step=jzero.StepOptions(manual_gather=True)),
    }
