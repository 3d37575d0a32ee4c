"""Every JAX internal jzero relies on, checked against the installed JAX.

``jzero.internal`` holds every use of JAX outside its public API (its README lists them).
Each test here names one internal: a module attribute, a primitive, the parameters and
operand order of a primitive, an attribute of traced equations and values, or the text of
a JAX error. When a JAX release changes one, the failing test says which internal moved
and on which JAX version; fix ``jzero/internal/`` and nothing else. The last tests re-run
one function through the interpreter and the unbound-axis diagnosis end to end.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jzero.internal import interpret, primitives
from jzero.internal.equation import Equation, equations, mentions, walk
from jzero.internal.primitives import (
    ELEMENTWISE,
    Kind,
    checkpoint_name_of,
    custom_vjp_body,
    is_copy_to_device,
    is_trimming_pad,
    kind,
    varying_axes,
)
from jzero.internal.unbound_axes import Unbound, unbound_axes


def _changed(internal: str, how: str) -> str:
    return (
        f"JAX {jax.__version__}: jzero relies on {internal}, which {how}. Update "
        "jzero/internal/ (its README lists every internal jzero uses)."
    )


ATTRIBUTES = [
    *(("jax.extend.core", n) for n in ("ClosedJaxpr", "Jaxpr", "JaxprEqn", "Literal", "Var")),
    ("jax.extend.core", "Primitive"),
    ("jax.extend.source_info_util", "summarize"),
    ("jax.core", "ShapedArray"),
    ("jax._src.distributed", "global_state"),  # jzero.internal.coordination
    ("jax._src.config", "_check_vma"),  # jzero.internal.vmap_axes
    *(("jax._src.compiler", n) for n in ("get_compile_options", "backend_compile_and_load")),
    ("jax._src.interpreters.mlir", "make_ir_context"),  # jzero.internal.cross_compile
]

# The coordination client's key-value calls jzero.internal.coordination makes (the client
# exists only after jax.distributed.initialize: its type is read from jaxlib).
CLIENT_METHODS = ("key_value_set", "key_value_try_get", "key_value_dir_get")


@pytest.mark.parametrize("module, name", ATTRIBUTES)
def test_module_attribute_exists(module, name):
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(_changed(f"the module {module}", f"cannot be imported ({e})"))
    assert hasattr(found, name), _changed(f"{module}.{name}", "no longer exists")


PRIMITIVES = {  # attribute of jax.extend.core.primitives -> the primitive's name
    "jit_p": "jit",
    "closed_call_p": "eval_jaxpr",  # named closed_call up to jax 0.10
    "remat_p": "remat2",
    "scan_p": "scan",
    "cond_p": "cond",
    "while_p": "while",
    "custom_vjp_call_p": "custom_vjp_call",
    "custom_jvp_call_p": "custom_jvp_call",
    "axis_index_p": "axis_index",
    "broadcast_in_dim_p": "broadcast_in_dim",
    "name_p": "name",
    "psum_p": "psum",
    "pmax_p": "pmax",
    "pmin_p": "pmin",
    "all_gather_p": "all_gather",
    "all_to_all_p": "all_to_all",
    "ppermute_p": "ppermute",
    "device_put_p": "device_put",
}
_ELEMENTWISE = [
    *("add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min", "clamp", "sqrt"),
    *("rsqrt", "cbrt", "pow", "integer_pow", "square", "exp", "exp2", "log", "log1p", "expm1"),
    *("tanh", "logistic", "select_n", "convert_element_type", "copy", "eq", "ne", "lt", "le"),
    *("gt", "ge", "and", "or", "not", "is_finite", "reduce_precision"),
]


@pytest.mark.parametrize(
    "attr, name", [*PRIMITIVES.items(), *((f"{n}_p", n) for n in _ELEMENTWISE)]
)
def test_primitive_exists_with_its_name(attr, name):
    from jax.extend.core import Primitive, primitives

    prim = getattr(primitives, attr, None)
    internal = f"jax.extend.core.primitives.{attr}"
    assert isinstance(prim, Primitive), _changed(internal, "no longer exists")
    assert prim.name == name, _changed(internal, f"is now named {prim.name!r}, not {name!r}")


def test_the_elementwise_set_is_what_its_names_say():
    assert sorted(p.name for p in ELEMENTWISE) == sorted(_ELEMENTWISE)
    assert all(kind(p) is Kind.ELEMENTWISE for p in ELEMENTWISE)


def _eqn(fn, *args, prim_name: str) -> Equation:
    """The first equation (at any depth) of ``fn``'s jaxpr whose primitive is ``prim_name``."""
    found = [e for e in walk(jax.make_jaxpr(fn)(*args)) if e.jaxpr_eqn.primitive.name == prim_name]
    assert found, _changed(f"the primitive {prim_name!r}", f"no longer appears in {fn}'s jaxpr")
    return found[0]


def _custom_vjp(x):
    @jax.custom_vjp
    def f(a, b):
        return a * b

    f.defvjp(lambda a, b: (a * b, (a, b)), lambda r, ct: (ct * r[1], ct * r[0]))
    return f(x, x + 1.0)


def _while(x, limit):
    return jax.lax.while_loop(lambda c: c.sum() < limit, lambda c: c * 2.0 + x, x)


X = jnp.arange(4.0)
PARAMS = {  # primitive -> (a function whose jaxpr holds it, the parameters jzero reads)
    "jit": (jax.jit(jnp.sin), ("jaxpr",)),
    "remat2": (jax.checkpoint(jnp.sin), ("jaxpr", "policy", "prevent_cse")),
    "scan": (
        lambda x: jax.lax.scan(lambda c, r: (c + r * x[0], c * r), 0.0, x),
        ("jaxpr", "ft_in", "length", "reverse", "unroll"),  # ft_in: (consts, carry, xs) trees
    ),
    "cond": (lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), ("branches",)),
    "while": (
        lambda x: _while(x, x.sum() * 9),
        ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"),
    ),
    "custom_vjp_call": (_custom_vjp, ("call_jaxpr", "num_consts")),
    "custom_jvp_call": (jax.nn.relu, ("call_jaxpr", "jvp_jaxpr_fun")),
    "pad": (lambda x: jax.lax.pad(x, 0.0, [(0, -1, 0)]), ("padding_config",)),
    "broadcast_in_dim": (lambda x: jnp.broadcast_to(x.sum(), (4,)), ("shape", "sharding")),
    "name": (lambda x: jax.ad_checkpoint.checkpoint_name(x, "n"), ("name",)),
    "device_put": (lambda x: jax.device_put(x, jax.memory.Space.Device), ("devices",)),
    # what the mixed-axes pass reads (jzero/internal/mixed_axes.py)
    "dot_general": (lambda x: jnp.outer(x, x) @ jnp.outer(x, x), ("dimension_numbers",)),
    "reduce_sum": (lambda x: x.sum(), ("axes",)),
    "transpose": (lambda x: jnp.outer(x, x).T, ("permutation",)),
    "squeeze": (lambda x: x[None].squeeze(0), ("dimensions",)),
    "cumsum": (lambda x: jnp.cumsum(x), ("axis",)),
    "concatenate": (lambda x: jnp.concatenate([x, x]), ("dimension",)),
}


@pytest.mark.parametrize("prim_name", sorted(PARAMS))
def test_primitive_parameters_jzero_reads(prim_name):
    fn, names = PARAMS[prim_name]
    params = _eqn(fn, X, prim_name=prim_name).jaxpr_eqn.params
    missing = [n for n in names if n not in params]
    assert not missing, _changed(
        f"the parameters {names} of {prim_name!r}", f"lack {missing} (it has {sorted(params)})"
    )


def test_an_equation_is_rebuilt_with_other_parameters():
    """leaf_batching compares scan bodies by text: JaxprEqn.replace(params=...)."""
    eqn = _eqn(lambda x: jnp.sin(x), X, prim_name="sin").jaxpr_eqn
    twin = eqn.replace(params={**eqn.params})
    assert twin.primitive is eqn.primitive, _changed("JaxprEqn.replace", "changed")


def test_closed_call_takes_its_body_as_call_jaxpr():
    from jax.extend.core import primitives

    body = jax.make_jaxpr(jnp.sin)(X)
    try:
        params = primitives.closed_call_p.get_bind_params({"call_jaxpr": body})
        out = primitives.closed_call_p.bind(X, **params)
    except (KeyError, TypeError) as e:
        pytest.fail(_changed("closed_call's (eval_jaxpr's) parameter 'call_jaxpr'", f"moved ({e})"))
    np.testing.assert_array_equal(out[0], jnp.sin(X))
    assert Equation(_eqn(lambda x: primitives.closed_call_p.bind(x, **params)[0], X,
                         prim_name="eval_jaxpr").jaxpr_eqn).call().jaxpr.eqns  # fmt: skip


def test_operand_orders_and_views():
    scan = _eqn(PARAMS["scan"][0], X, prim_name="scan")
    parts = scan.scan(list(scan.inputs))
    assert [len(parts.consts), len(parts.init), len(parts.xs)] == [1, 1, 1], _changed(
        "scan's operands (num_consts constants, num_carry carries, then xs)", f"gave {parts}"
    )
    assert parts.xs[0].aval.shape == (4,) and parts.init[0].aval.shape == ()
    assert (parts.length, parts.reverse) == (4, False)
    loop = _eqn(PARAMS["while"][0], X, prim_name="while")
    parts = loop.while_loop(list(loop.inputs))
    assert [len(parts.cond_consts), len(parts.body_consts), len(parts.init)] == [1, 1, 1], _changed(
        "while's operands (cond_nconsts, body_nconsts constants, then the carry)", f"gave {parts}"
    )
    assert parts.cond_consts[0].aval.shape == () and parts.body_consts[0].aval.shape == (4,)
    cond = _eqn(PARAMS["cond"][0], X, prim_name="cond")
    parts = cond.cond(list(cond.inputs))
    assert len(parts.branches) == 2 and len(parts.operands) == 1
    assert parts.index.aval.dtype == jnp.int32, _changed("cond's operand 0 (the index)", "moved")
    vjp = _eqn(_custom_vjp, X, prim_name="custom_vjp_call")
    assert len(vjp.custom_vjp_args(vjp.inputs)) == 2, _changed(
        "custom_vjp_call's operands (num_consts constants, then the arguments)", "changed"
    )
    remat = _eqn(PARAMS["remat2"][0], X, prim_name="remat2").remat()
    assert remat.policy is None and remat.prevent_cse is True


def test_remat_policies_read_pads_and_names():
    pad = _eqn(PARAMS["pad"][0], X, prim_name="pad").jaxpr_eqn
    assert is_trimming_pad(pad.primitive, pad.params), _changed("pad's padding_config", "changed")
    name = _eqn(PARAMS["name"][0], X, prim_name="name").jaxpr_eqn
    assert checkpoint_name_of(name.primitive, name.params) == "n"
    put = _eqn(PARAMS["device_put"][0], X, prim_name="device_put").jaxpr_eqn
    assert is_copy_to_device(put.primitive, put.params), _changed(
        "device_put's devices (a jax.memory.Space target)", "changed"
    )
    vjp = _eqn(_custom_vjp, X, prim_name="custom_vjp_call").jaxpr_eqn
    body = [p.name for p, _ in custom_vjp_body(vjp.primitive, vjp.params)]
    assert body == ["mul"], _changed(
        "custom_vjp_call's call_jaxpr (the primal function)", "changed"
    )


def test_equations_carry_context_source_and_bind_params():
    eqn = _eqn(lambda x: jnp.sin(x), X, prim_name="sin").jaxpr_eqn
    with eqn.ctx.manager:  # an equation's abstract mesh, compute_on, XLA metadata
        pass
    assert callable(eqn.primitive.get_bind_params), _changed("Primitive.get_bind_params", "is gone")
    assert isinstance(eqn.primitive.multiple_results, bool)
    where = Equation(eqn).where
    assert "test_jax_internals.py" in where, _changed("JaxprEqn.source_info / summarize", where)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_varying_axes_and_the_pvary_cast():
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = varying_axes(x), varying_axes(w)
        return (x + jax.lax.psum(w, "data").sum())[None]

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=(P("data"), P()), out_specs=P("data"))
    traced = jax.make_jaxpr(fn)(jnp.ones(8), jnp.ones(3))
    assert seen == {"x": frozenset({"data"}), "w": frozenset()}, _changed(
        "jax.typeof(x).mat.varying (ShapedArray's varying mesh axes)", f"gives {seen}"
    )
    kinds = {e.kind for e in walk(traced)}
    assert Kind.PVARY in kinds, _changed(
        "the primitive jax.lax.pcast(..., to='varying') binds (pvary: before a psum of an "
        "invariant value)",
        "is gone",
    )
    pvary = next(e for e in walk(traced) if e.kind is Kind.PVARY)
    assert pvary.axis_names == {"data"}, _changed("pvary's 'axes' parameter", "changed")
    assert mentions(traced, {"data"})


def test_the_collectives_shard_map_binds_are_found_by_tracing_public_functions():
    found = {p.name: name for p, name in primitives.collectives().items()}
    for api in ("pcast", "psum/pmean", "psum_scatter", "all_gather", "pmax", "ppermute"):
        assert api in found.values(), _changed(
            f"the primitive jax.lax.{api} binds inside shard_map", f"was not found ({found})"
        )
    assert primitives.pvary_primitive() is not None
    missing = primitives.MISSING
    assert not missing, _changed(f"jax.extend.core.primitives.{missing}", "is gone")


def test_collectives_name_their_axes():
    def body(x):
        g = jax.lax.all_gather(x, "data", tiled=True)
        i = jax.lax.axis_index("data").astype(jnp.float32)
        s = jax.lax.psum_scatter(g, "data", tiled=True)
        return (jax.lax.pmax(x, "data") + i + s + jax.lax.pmean(x, "data"))[:1]

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"))
    named = {
        e.jaxpr_eqn.primitive.name: e.axis_names for e in walk(jax.make_jaxpr(fn)(X.repeat(2)))
    }
    for prim in ("all_gather", "axis_index", "reduce_scatter", "pmax", "psum_invariant"):
        assert named.get(prim) == {"data"}, _changed(
            f"{prim}'s axes parameter ('axes' or 'axis_name')", f"gives {named.get(prim)}"
        )


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jax.lax.psum(x, "nowhere"),  # a traced value: psum's own check
        lambda x: jax.lax.all_gather(x, "nowhere"),  # the axis environment's check
    ],
)
def test_an_unbound_axis_name_is_named_in_the_name_error(fn):
    with pytest.raises(NameError) as e:
        jax.make_jaxpr(fn)(X)
    assert re.search(r"unbound axis name: nowhere(\. To fix this|$)", str(e.value)), _changed(
        "the text of JAX's NameError for an unbound axis name", f"is now {str(e.value)!r}"
    )


def test_unbound_axes_names_each_collective_and_where():
    def loss(x):
        y = jax.lax.pcast(x, "data", to="varying")
        y = jax.lax.pmean(jax.lax.all_gather(y, "data", tiled=True).sum(), "batch")
        return y + jax.lax.all_gather(x, "devices").sum()

    found = unbound_axes(loss, (X,), {"data": 8})
    assert [(u.axis, u.collective) for u in found] == [
        ("batch", "psum/pmean"),
        ("devices", "all_gather"),
    ]
    assert all(isinstance(u, Unbound) and "test_jax_internals.py" in u.where for u in found)
    assert unbound_axes(loss, (X,), {"data": 8, "batch": 8, "devices": 2}) == []
    # inside a step's shard_map, whose mesh (8 devices) is smaller than the known axes'
    inside = []

    def body(x):
        inside.extend(unbound_axes(loss, (x,), {"data": 8, "batch": 8}))
        return x

    jax.make_jaxpr(jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data")))(
        X.repeat(2)
    )
    assert [u.axis for u in inside] == ["devices"]


def _everything(x, w):
    """A function with every higher-order kind the interpreter walks through."""

    def row(c, r):
        return c + jnp.tanh(r * w), jax.lax.cond(r > 1.0, jnp.sin, jnp.cos, r)

    c, ys = jax.lax.scan(row, 0.0, x)
    v0, wc = jax.lax.stop_gradient((x, w))  # reverse mode cannot differentiate a while loop
    loop = jax.lax.while_loop(lambda v: v.sum() < 50.0, lambda v: v * 1.5 + wc, v0)
    inner = jax.jit(lambda a: jax.checkpoint(lambda b: jnp.exp(b) * w)(a))(x)
    return c + ys.sum() + loop.sum() + inner.sum() + _custom_vjp(x).sum()


@pytest.mark.smoke  # jzero's one jaxpr interpreter on this JAX
def test_the_interpreter_re_runs_every_kind_exactly():
    """Each equation bound as traced, and each higher-order primitive rebuilt with its body
    re-run (rebind), give the function's own value and gradient, bit for bit."""

    class RebindAll(interpret.Interpreter):
        def apply(self, eqn, values):
            return interpret.rebind(eqn, values, self) if eqn.kind in interpret.REBINDS else None

    w = jnp.float32(0.3)
    traced = jax.make_jaxpr(_everything)(X, w)
    top, nested = {e.kind for e in equations(traced)}, {e.kind for e in walk(traced)}
    assert top >= {Kind.SCAN, Kind.WHILE, Kind.CALL, Kind.CUSTOM_VJP}
    assert nested >= {Kind.REMAT, Kind.COND}
    want = jax.jit(jax.value_and_grad(_everything, argnums=(0, 1)))(X, w)
    for rules in (interpret.Interpreter(), RebindAll()):
        replay = lambda x, w, rules=rules: interpret.run(traced, [x, w], rules)[0]
        got = jax.jit(jax.value_and_grad(replay, argnums=(0, 1)))(X, w)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1][0], want[1][0])
        np.testing.assert_array_equal(got[1][1], want[1][1])


def test_the_coordination_client_has_the_key_value_calls_jzero_makes():
    from jax._src import distributed

    state = distributed.global_state
    assert hasattr(state, "client"), _changed("jax._src.distributed.global_state.client", "is gone")
    from jax._src.lib import _jax

    client_type = getattr(_jax, "DistributedRuntimeClient", None)
    assert client_type is not None, _changed("jaxlib's DistributedRuntimeClient", "is gone")
    for name in CLIENT_METHODS:
        assert hasattr(client_type, name), _changed(f"DistributedRuntimeClient.{name}", "is gone")


def test_an_unchecked_vmap_reduces_its_own_axis_over_positions():
    """jzero.internal.vmap_axes reads a vmap's named psum, traced without varying-axes
    checks, as a psum over array positions (``axes`` holding ints)."""
    from jax._src import config

    def loss(x):
        return jax.vmap(lambda r: jax.lax.psum(r, "batch"), axis_name="batch")(x).sum()

    with config._check_vma(False):
        eqn = _eqn(loss, X, prim_name="psum")
    axes = eqn.jaxpr_eqn.params["axes"]
    assert all(isinstance(a, int) for a in axes), _changed(
        "a vmap's own psum (traced unchecked)", f"now has axes {axes!r}, not array positions"
    )
