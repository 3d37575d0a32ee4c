"""A Llama-style decoder LM in Flax NNX, at Llama 3's 8 B and 70 B shapes or tiny.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, with an
untied output head: the architecture of Llama 3 (Meta's model card and ``params.json``:
8 B is 32 layers of width 4096, 70 B 80 layers of width 8192, both with 8 key-value heads
and a 128,256-token vocabulary). Written as Flax's NNX guides write it today: the blocks
are made by ``nnx.vmap`` over split ``Rngs`` (one stacked ``Block`` whose parameters carry a
leading layer axis) and run by a scan over them, each layer rematerialised
(``jax.checkpoint``), as large-model trainers run them.

The scan body ``nnx.merge`` s one layer's state into the block and passes it through
:func:`jzero.gather` first, as the embedding, the final norm and the head pass theirs: in
jzero's own step and on plain arrays that is the identity; in your own ``jit`` step at
stage 3 (``gather_mesh=mesh``) it tells the compiler to gather each where it is used, one
layer at a time (leave one out and the compiler may reshard the activations around it
instead).

Nothing here allocates the model: :func:`abstract` builds it with ``nnx.eval_shape``, and
:func:`problem` hands :func:`jzero.autoconfigure` an ``init_fn`` it only traces.

Tensor names carry their shapes: B batch, T time, D width, H query heads, G key-value
heads, K head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jzero


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128_256
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn: int = 14_336
    seq_len: int = 4096
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    dtype: Any = jnp.bfloat16  # the computation's; parameters are made in fp32
    remat: bool = True  # recompute each layer in backward from its input
    gather_mesh: Any = None  # jzero.gather(..., mesh=): stage 3 in your own jit step


SIZES = {
    "8b": LlamaConfig(),
    "70b": LlamaConfig(d_model=8192, n_layers=80, n_heads=64, ffn=28_672),
    "tiny": LlamaConfig(
        vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn=384, seq_len=128
    ),
}
"""Llama 3's 8 B and 70 B shapes (training sequences of 4096 tokens), and one for tests."""


def rope_tables(cfg: LlamaConfig, T: int) -> tuple[jax.Array, jax.Array]:
    """``cos``, ``sin`` of the rotary angles, ``float32[T, K/2]``."""
    K = cfg.d_model // cfg.n_heads
    inv_freq = cfg.rope_theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angles_TxK2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_TxK2), jnp.sin(angles_TxK2)


def rotate(x_BxTxHxK: jax.Array, cos_TxK2: jax.Array, sin_TxK2: jax.Array) -> jax.Array:
    """Rotary embedding, the halves convention of Llama's reference code in JAX ports."""
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_TxK2[None, :, None, :], sin_TxK2[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxK.dtype)


class Block(nnx.Module):
    """x + attention(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        dense = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs,
                                  kernel_init=nnx.initializers.normal(0.02))  # fmt: skip
        self.attn_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
        self.q, self.k, self.v = dense(D, H * K), dense(D, G * K), dense(D, G * K)
        self.o = dense(H * K, D)
        self.mlp_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
        self.gate, self.up, self.down = dense(D, cfg.ffn), dense(D, cfg.ffn), dense(cfg.ffn, D)
        self.heads = (H, G, K)

    def __call__(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, T, _ = x_BxTxD.shape
        H, G, K = self.heads
        h_BxTxD = self.attn_norm(x_BxTxD)
        q_BxTxHxK = rotate(self.q(h_BxTxD).reshape(B, T, H, K), cos, sin)
        k_BxTxGxK = rotate(self.k(h_BxTxD).reshape(B, T, G, K), cos, sin)
        v_BxTxGxK = self.v(h_BxTxD).reshape(B, T, G, K)
        attn_BxTxHxK = jax.nn.dot_product_attention(
            q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, is_causal=True, implementation="xla"
        )
        x_BxTxD = x_BxTxD + self.o(attn_BxTxHxK.reshape(B, T, H * K))
        h_BxTxD = self.mlp_norm(x_BxTxD)
        return x_BxTxD + self.down(nnx.silu(self.gate(h_BxTxD)) * self.up(h_BxTxD))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))  # fmt: skip

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                               kernel_init=nnx.initializers.normal(0.02), rngs=rngs)  # fmt: skip

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        cfg = self.cfg
        cos, sin = rope_tables(cfg, tokens_BxT.shape[1])
        graphdef, stacked = nnx.split(self.blocks)

        def layer(x_BxTxD, state):
            return nnx.merge(graphdef, gathered(state, cfg))(x_BxTxD, cos, sin), None

        body = jax.checkpoint(layer) if cfg.remat else layer
        embed, norm, head = (whole(m, cfg) for m in (self.embed, self.norm, self.head))
        x_BxTxD, _ = jax.lax.scan(body, embed(tokens_BxT), stacked)
        return head(norm(x_BxTxD))


def gathered(state: nnx.State, cfg: LlamaConfig) -> nnx.State:
    """``state`` whole where it is used (:func:`jzero.gather`; with ``cfg.gather_mesh``,
    constrained whole on it, for stage 3 in your own ``jit`` step)."""
    return jzero.gather(state, mesh=cfg.gather_mesh)


def whole(module: nnx.Module, cfg: LlamaConfig) -> nnx.Module:
    """``module`` with its parameters :func:`gathered`."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, gathered(state, cfg))


def abstract(cfg: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters' shapes; nothing the model's size is made."""
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def init_params(cfg: LlamaConfig) -> nnx.State:
    """Fresh parameters (traceable: ``jit`` and ``jax.eval_shape`` take it)."""
    return nnx.state(Llama(cfg, rngs=nnx.Rngs(0)))


def make_loss_fn(cfg: LlamaConfig, graphdef: nnx.GraphDef):
    """``loss_fn(params, batch)``: mean next-token cross-entropy; batch = {"tokens": [B, T+1]}."""

    def loss_fn(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        tokens_BxTp1 = batch["tokens"]
        logits_BxTxV = nnx.merge(graphdef, params)(tokens_BxTp1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BxTxV.astype(jnp.float32), tokens_BxTp1[:, 1:]
        ).mean()

    return loss_fn


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def problem(*, size: str = "tiny", batch: int = 64, seq_len: int | None = None,
            lr: float = 3e-4) -> dict[str, Any]:  # fmt: skip
    """The model's training step as :func:`jzero.autoconfigure` takes it (and ``python -m
    jzero autoconfigure examples/llama.py:problem --set size=8b --target h100:8``): its
    loss, its parameters' ``init_fn`` (only traced), a global batch of ``batch`` sequences,
    AdamW, and bf16 parameters over fp32 master weights and moments."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}.")
    cfg = SIZES[size]
    cfg = cfg if seq_len is None else dataclasses.replace(cfg, seq_len=seq_len)
    graphdef, _ = abstract(cfg)
    precision = jzero.Precision(param_dtype="bf16")
    return {
        "loss_fn": make_loss_fn(cfg, graphdef),
        "init_fn": functools.partial(init_params, cfg),
        "batch": {"tokens": jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32)},
        "tx": optax.adamw(lr, weight_decay=0.1),
        "config": jzero.ZeroConfig(stage=0, precision=precision),
    }
