"""Re-running a traced equation: the one step the jaxpr interpreters share.

Three parts of jzero trace a function once and evaluate its jaxpr equation by equation,
changing some equations and binding the others as traced: stage 3's deferred gathers
(:mod:`.gather.autogather`), batch-axis aliases (:mod:`.axis_alias`) and the offloaded update's
split (:mod:`.offload.split`). :func:`bind` is how each binds an equation unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import JaxprEqn, Literal


def bind(eqn: JaxprEqn, args: Sequence[Any], params: dict[str, Any] | None = None) -> list:
    """``eqn``'s primitive applied to ``args`` (with ``params``, default ``eqn.params``)
    in the equation's context, as ``jax.core.eval_jaxpr`` would; always a list of outputs."""
    prim = eqn.primitive
    with eqn.ctx.manager:
        out = prim.bind(*args, **prim.get_bind_params(eqn.params if params is None else params))
    return list(out) if prim.multiple_results else [out]


def read(env: dict, v: Any) -> Any:
    """The value of a jaxpr atom: a literal's own, or a variable's from ``env``."""
    return v.val if isinstance(v, Literal) else env[v]
