"""Stage 3's default gathering: each parameter gathered where the loss consumes it.

Without ``manual_gather``, stage 3 must hand the loss function full parameters. Gathering
them all up front holds the whole model on every device. Instead the loss is traced once
(``jax.make_jaxpr``) on gathered parameters and then re-run equation by equation with each
``jzero.gather`` deferred until the first equation that reads its result:

- a ``lax.scan`` (``nn.scan``, ``nnx.scan``) that takes a stacked parameter as one of its
  scanned inputs (``xs``) gets the sharded stack instead, and gathers each layer's slice
  inside its body: one layer gathered at a time, forward and (under the step's remat
  policy, which never saves a gathered parameter) backward;
- a ``jax.jit`` / ``closed_call`` is inlined and a ``jax.checkpoint`` (``nn.remat``) is
  re-applied with its own policy (plus "never save a gathered parameter"), so that
  parameters passed through them stay deferred down to their scans;
- a ``fori_loop`` body that only indexes a stacked parameter (``w[i]``) gathers each
  layer at its use inside the step;
- elsewhere (an unrolled model) a parameter used once is gathered *at its use*, in a
  :func:`jzero.remat_layer` of that one equation, and again in backward
  (:mod:`.deferred`); ``params['blocks'][i]`` of a stack takes the layer's shards first.
  A parameter used more than once (a tied embedding) is gathered where first used, once,
  and held; a dry run of the interpreter counts the uses. With a remat policy
  (``StepOptions(remat_policy=...)``) the model's repeated layers, found from the
  parameters (:mod:`.layers`), each run as one :func:`jzero.remat_layer` with the policy
  instead: recomputed layer by layer, as ``layers=`` does for Flax models.

Every other equation is bound as traced, so the numerics are the user's own: only where
and how often the all-gathers happen changes (docs/design.md §4). The loss's jaxpr is
evaluated by jzero's jaxpr interpreter (:mod:`jzero.internal.interpret`) under
:class:`_Gathering`.
"""

from __future__ import annotations

import collections
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ...internal.equation import (
    Equation,
    Remat,
    Scan,
    constants,
    equations,
    only_indexed,
    trace,
    walk,
    without_dead_equations,
)
from ...internal.interpret import Interpreter, narrowest_cut, run, run_in_regions
from ...internal.moved import InternalMoved, warn_fallback
from ...internal.primitives import Kind
from ..comm.collectives import saves_no_gathered
from ..comm.gatherer import Sharded, gather, gather_each
from .deferred import Deferred, Derived, derive, gathered_at, is_lazy, use
from .layers import layer_gaps, layer_of
from .prefetch import can_prefetch, prefetched_scan
from .remat import remat_layer

_KEEP = jax.checkpoint_policies.everything_saveable
CARRY = "jzero_carry"  # a scan step's input carry, saved as itself (_carry_named)


def gather_where_used(
    fn: Callable[..., Any],
    *,
    prefetch: bool = False,
    policy: Callable[..., Any] | None = None,
    scans_only: bool = False,
) -> Callable[..., Any]:
    """``fn(params, *args)`` for ``params`` holding :class:`Sharded` handles, each gathered
    where ``fn`` uses it (per layer inside scans over stacked parameters). ``policy``: what
    backward keeps of each scan step and each repeated layer of an unrolled model
    (:attr:`jzero.StepOptions.remat_policy`).

    Without ``policy`` (stage 3), backward gathers again what forward gathered whole and
    held (a parameter used more than once, a scan's constants, one read by a loop or
    branch): the evaluation runs under a checkpoint that keeps every activation but no
    gathered parameter. Where every parameter is gathered at its one use (each use
    re-gathers in backward itself) there is nothing for that checkpoint to act on, and it
    is left off: it would re-trace and re-stage the whole loss for nothing.

    ``scans_only`` (stage 2, whose handles hold the whole parameter): only scans over
    stacked parameters, and loops that index them, take them one layer at a time, so that
    each layer's gradient is reduce-scattered inside the backward loop step that completes
    it; everywhere else a parameter is used whole where first read, and held. A loss with
    none of those (a dry run of its jaxpr says so) is traced again as written, on every
    parameter whole: JAX's own jitted functions (``jax.nn.gelu``, ``jnp.mean``) are then
    differentiated once per shape, not equation by equation.

    Equal to ``fn(jzero.gather(params), *args)`` in value and gradient.
    """

    regather = policy is None and not scans_only  # a stage-2 handle holds no gather

    def call(params: Any, *args: Any) -> Any:
        try:
            return per_use(params, *args)
        except InternalMoved as moved:
            _warn_whole(params, moved, prefetch=prefetch, scans_only=scans_only)
            whole = lambda p, *a: fn(gather_each(p), *a)
            return (_regathering(whole) if regather else whole)(params, *args)

    def per_use(params: Any, *args: Any) -> Any:
        whole = lambda p, *a: fn(gather_each(p), *a)
        traced, out_shape = trace(whole, params, *args, return_shape=True)
        traced = without_dead_equations(traced)
        if scans_only:
            if not _counted(traced, params, args, scans_only=True).takes_layers:
                return whole(params, *args)  # nothing per layer: traced again as written
            rules = _Gathering(_handles(params), scans_only=True)
            out = run(traced, jax.tree.leaves((params, args)), rules)
            return jax.tree.unflatten(jax.tree.structure(out_shape), out)
        shared, reads, holds = _dry_run(traced, params, args)
        spans = [] if policy is None else _spans(traced, _layers(params), reads)
        if policy is not None and not spans and reads is not None:
            warnings.warn(_NOTHING_TO_RECOMPUTE, stacklevel=2)

        def evaluate(params: Any, args: tuple) -> list[Any]:
            rules = _Gathering(_handles(params), prefetch=prefetch, policy=policy, shared=shared)
            leaves = jax.tree.leaves((params, args))
            if not spans:
                return run(traced, leaves, rules)

            def layer(body: Callable, values: list[Any]) -> list[Any]:  # one of the layers,
                run_body = lambda inputs: body(_Gathering(), inputs)  # recomputed by policy
                return gathered_at(run_body, values, list(map(is_lazy, values)), rules.read, policy)

            return run_in_regions(traced, leaves, rules, spans, layer)

        out = (_regathering(evaluate) if regather and holds else evaluate)(params, args)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return call


def _regathering(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under a checkpoint that keeps every activation but no gathered parameter."""
    return jax.checkpoint(fn, policy=saves_no_gathered(_KEEP))


_NOTHING_TO_RECOMPUTE = (
    "StepOptions(remat_policy=...) has no layer to act on in this loss: no lax.scan or "
    "jax.checkpoint takes stage 3's parameters, and no repeated layers were found (numbered "
    "siblings with equal subtrees -- blocks_0, blocks_1, ... or a list of layers -- whose "
    "parameters are read one layer after another, with no other parameter read between "
    "them). Backward keeps every activation, as with remat_policy=None. Wrap each layer in "
    "jax.checkpoint (or use jzero.remat_layer with manual_gather=True, or layers= with the "
    "Flax adapters), or leave remat_policy=None."
)


def _warn_whole(params: Any, moved: InternalMoved, *, prefetch: bool, scans_only: bool) -> None:
    """Warns that the loss runs on every parameter used whole (:func:`gather_each`)."""
    if scans_only:
        warn_fallback(
            "stage 2's per-layer gradient reduction in scans",
            moved,
            "each stacked gradient is reduce-scattered after the backward loop",
            f"up to {_whole_model_bytes(params):,} bytes of whole stacked gradients per "
            "device held at once, instead of about one layer's",
        )
        return
    warn_fallback(
        "stage 3's per-layer gathering" + (" and prefetch" if prefetch else ""),
        moved,
        "every parameter is gathered at the start of the loss and held through it",
        f"{_whole_model_bytes(params):,} bytes of gathered parameters per device "
        "held at once, instead of about one layer's",
    )


def _whole_model_bytes(params: Any) -> int:
    """The bytes of every parameter gathered whole, on one device."""
    shapes = (h.layout.shape for h in _handles(params))
    dtypes = (jax.typeof(h.value).dtype for h in _handles(params))
    return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))


def _is_handle(x: Any) -> bool:
    return isinstance(x, Sharded)


def _handles(params: Any) -> list[Sharded]:
    return [x for x in jax.tree.leaves(params, is_leaf=_is_handle) if _is_handle(x)]


def _layers(params: Any) -> list[int | None]:
    """Each handle's repeated layer (:func:`.layers.layer_of`), in :func:`_handles`' order."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_handle)[0]
    handles = [(path, x) for path, x in leaves if _is_handle(x)]
    return layer_of([p for p, _ in handles], [tuple(x.layout.shape) for _, x in handles])


def _spans(traced: Any, layers: list[int | None], reads: dict | None) -> list[tuple[int, int]]:
    """Each repeated layer's equations (:mod:`.layers`), cut where the fewest bytes cross."""
    if not reads:  # None: the model's own scans and checkpoints are its layers
        return []
    reads = dict(reads)
    derived = reads.pop(DERIVED, [])
    gaps = layer_gaps(layers, reads, len(equations(traced)))
    if gaps:  # the first layer starts after the (deferred) gathers, and after the casts
        # and reshapes of parameters before it: a span that began before them would hand
        # their (lazy) results on to the later layers, gathered
        lo, hi = gaps[0]
        before = [e for e in (*reads[-1], *derived) if e is not None and e < hi]
        gaps[0] = (min(max(lo, max(before, default=-1) + 1), hi), hi)
    cuts = [narrowest_cut(traced, lo, hi) for lo, hi in gaps]
    return list(zip(cuts[:-1], cuts[1:]))


DERIVED = -2
"""The dry run's key, among the reads by handle position, of the top-level equations that
derive a lazy value from parameters alone (a cast, reshape or transpose)."""


def _dry_run(traced: Any, params: Any, args: tuple) -> tuple[frozenset[int], dict | None, bool]:
    """What a dry run (traced, then dropped) of ``traced`` finds: the keys
    (:attr:`Deferred.key`) of the deferred parameters used more than once outside loops
    and checkpoints; by handle position the top-level equations that read each
    (position -1: the gathers themselves), or None if a scan or checkpoint takes deferred
    parameters (the model has layers of its own, and the policy acts there alone); and
    whether the run gathers some parameter whole outside a use and holds it: one used
    more than once, or read by a scan, checkpoint, loop or branch."""
    rules = _counted(traced, params, args, shared=frozenset())
    shared = frozenset(k for k, n in rules.uses.items() if n > 1)
    holds = bool(shared) or rules.own_layers or rules.reads_whole
    return shared, None if rules.own_layers else dict(rules.reads), holds


def _counted(traced: Any, params: Any, args: tuple, **options: Any) -> _Gathering:
    """The rules (``options``) after a dry run of ``traced``, counting (nothing bound)."""
    found = []

    def dry(params: Any, *args: Any) -> list:
        rules = _Gathering(_handles(params), counting=True, **options)
        found.append(rules)
        run(traced, jax.tree.leaves((params, args)), rules, before=rules.entering)
        return []  # the run's outputs are _NOT_BOUND

    trace(dry, params, *args)
    return found[0]


_NOT_BOUND = object()
"""What the dry run (counting) gives for an equation's outputs: it binds nothing, as only
which equations read which parameters counts, and an unbound equation costs no trace."""


class _Gathering(Interpreter):
    """The rules of deferred gathering (see the module docstring) for jzero's interpreter:
    ``handles``' gathers (``jzero.gather``'s ``custom_vjp``, called on a handle's
    sink and value) are deferred; the first equation that reads a deferred value gathers
    it, unless it is a scan, an inlined call or a checkpoint that can take it deferred, or
    the value's one use (:func:`.deferred.use`).

    ``shared``: the keys of the parameters used more than once (gathered where first read,
    and held); None inside loop bodies, where nothing is gathered per use. ``counting``:
    a dry run that counts each parameter's uses in :attr:`uses` (nothing per use).
    ``scans_only``: stage 2's rules (:func:`gather_where_used`): only scans, indexing and
    checkpoints take deferred parameters as they are; any other equation reads them whole,
    once.
    """

    def __init__(
        self,
        handles: Sequence[Sharded] = (),
        *,
        prefetch: bool = False,
        policy: Callable[..., Any] | None = None,
        shared: frozenset[int] | None = None,
        counting: bool = False,
        scans_only: bool = False,
    ):
        self.handles = {id(h.sink): h for h in handles}
        self.position = {id(h.sink): i for i, h in enumerate(handles)}
        self.at: int | None = None  # counting: the top-level equation being evaluated
        self.reads: dict[int, list[int]] = collections.defaultdict(list)  # by position
        self._positions: dict[int, int] = {}  # counting: key -> handle position
        self.own_layers = False  # counting: a scan or checkpoint takes deferred parameters
        self.reads_whole = False  # counting: another equation that is no use reads one
        self.takes_layers = False  # counting: a scan, checkpoint or index takes one deferred
        self.prefetch, self.shared, self.counting = prefetch, shared, counting
        self.policy, self.scans_only = policy, scans_only
        self.uses: collections.Counter[int] = collections.Counter()
        self._keys = itertools.count()
        self.uses_built: dict[Any, Callable] = {}  # deferred.use's, by what they compute

    def entering(self, index: int) -> None:
        """Counting: the top-level equation ``index`` is evaluated next."""
        self.at = index

    def nested(self) -> _Gathering:
        """The rules for a loop body: the same options, nothing gathered per use."""
        return _Gathering(prefetch=self.prefetch, policy=self.policy, scans_only=self.scans_only)

    def read(self, x: Any, atom: Any = None) -> Any:
        del atom
        if self.counting and is_lazy(x):
            self._count(x)
        if self.counting and isinstance(x, Deferred | Derived):
            return _NOT_BOUND  # nothing gathered: the dry run binds nothing
        if isinstance(x, Derived):
            return x.value()
        return x.full() if isinstance(x, Deferred) else x  # first use: gathered here

    def apply(self, eqn: Equation, values: list[Any]) -> list[Any] | None:
        outs = self._apply(eqn, values)
        if outs is not None or not self.counting:
            return outs
        for x, atom in zip(values, eqn.inputs):  # counting binds nothing: it reads
            self.read(x, atom)
        return [_NOT_BOUND] * len(eqn.outputs)

    def _apply(self, eqn: Equation, values: list[Any]) -> list[Any] | None:
        if eqn.kind is Kind.CUSTOM_VJP and (handle := self._gathered(eqn, values)) is not None:
            return [self._deferred(handle)]  # jzero.gather: deferred
        if not any(isinstance(x, Deferred | Derived) for x in values):
            return None
        if eqn.kind is Kind.CALL:
            return run(eqn.call(), values, self)
        if self.counting and eqn.kind in (Kind.SCAN, Kind.REMAT):
            self.own_layers = self.takes_layers = True  # the model has layers of its own
            return None  # each deferred input read: one use
        if eqn.kind is Kind.SCAN:
            return _scan(eqn.scan(values), self)
        if eqn.kind is Kind.REMAT:
            return _checkpoint(eqn.remat(), values)
        if (layer := self._indexed(eqn, values)) is not None:
            return [layer]
        if self.scans_only:
            return None  # read whole where first used
        if eqn.first_order and any(map(is_lazy, values)):
            if not self.counting:
                return use(eqn, values, self.read, self.uses_built)
            if (derived := derive(eqn, values)) is not None:  # read where it is used
                self.uses.update(x.key for x in values if isinstance(x, Deferred))
                self.reads[DERIVED].append(self.at)
                return derived
            return None  # each lazy input read: one use
        self.reads_whole = self.reads_whole or self.counting  # a loop or branch: read whole
        return None

    def _count(self, x: Deferred | Derived) -> None:
        """Counting: ``x`` read by the current top-level equation (a use of a parameter
        read directly; a derived value's uses were counted where it was derived)."""
        bases = x.bases if isinstance(x, Derived) else [x]
        if isinstance(x, Deferred):
            self.uses.update(b.key for b in bases)
        for b in bases:
            if b.key in self._positions:
                self.reads[self._positions[b.key]].append(self.at)

    def _deferred(self, handle: Sharded, parent: Deferred | None = None) -> Deferred:
        if self.scans_only:
            return Deferred(handle)  # read whole where first used, once
        if self.shared is None:  # a loop body: a layer indexed from a stack (a fori_loop's
            return Deferred(handle, per_use=parent is not None)  # w[i]) gathered at its use
        key = next(self._keys)
        if self.counting and id(handle.sink) in self.position:
            self._positions[key] = self.position[id(handle.sink)]
            self.reads[-1].append(self.at)  # where the gathers are: before any layer
        elif self.counting and parent is not None and parent.key in self._positions:
            self._positions[key] = self._positions[parent.key]  # x[i]: a read of x
        return Deferred(handle, key=key, per_use=key not in self.shared)

    def _indexed(self, eqn: Equation, values: list[Any]) -> Deferred | None:
        """``x[i]`` of a deferred stack ``x`` (``params['blocks'][i]``, a ``fori_loop``'s
        ``w[i]``): the layer's shards, deferred."""
        x, i = values[0], eqn.leading_index(values)
        if i is None or not isinstance(x, Deferred) or not x.indexable():
            return None
        if i is _NOT_BOUND:  # counting: any layer stands for the one indexed
            i = 0
        self.takes_layers = self.takes_layers or self.counting
        return self._deferred(x.layer(i), parent=x)

    def _gathered(self, eqn: Equation, values: list[Any]) -> Sharded | None:
        """The handle whose gather ``eqn`` is (its first argument is the handle's sink)."""
        args = eqn.custom_vjp_args(values)
        handle = self.handles.get(id(args[0])) if args else None
        return handle if handle is not None and args[0] is handle.sink else None


def _scan(scan: Scan, rules: _Gathering) -> list[Any]:
    """A ``scan`` whose deferred scanned inputs are sliced sharded and gathered per step."""
    n_carry = len(scan.init)
    # Used by every step: gathered once; but a deferred stack that the body only indexes
    # (a fori_loop's w[i]) stays deferred, and each step gathers its layer.
    per_step = lambda i, x: isinstance(x, Deferred) and x.indexable() and only_indexed(scan.body, i)
    consts = [x if per_step(i, x) else rules.read(x) for i, x in enumerate(scan.consts)]
    init = [rules.read(x) for x in scan.init]
    # A stack sharded along its stacked axis cannot be sliced per step: gathered whole.
    sliceable = lambda x: isinstance(x, Deferred) and x.handle.layout.axis(x.handle.value) > 0
    xs = [x if sliceable(x) else rules.read(x) for x in scan.xs]
    scanned = [x.handle if isinstance(x, Deferred) else x for x in xs]
    lazy = [isinstance(x, Deferred) for x in xs]
    body_consts = constants(scan.body)

    whole = [x for x in consts if not isinstance(x, Deferred)]
    if rules.prefetch and any(lazy) and can_prefetch(body_consts, whole, init, scanned):
        consts = [rules.read(x) for x in consts]
        handles = [x for x, d in zip(scanned, lazy) if d]
        others = [x for x, d in zip(scanned, lazy) if not d]
        n_body = len(body_consts)

        def layer(all_consts, carry, params, x_others):
            params, x_others = iter(params), iter(x_others)
            slices = [next(params) if d else next(x_others) for d in lazy]
            args = [*all_consts[n_body:], *carry, *slices]
            outs = run(scan.body, args, _Gathering(), consts=all_consts[:n_body])
            return outs[:n_carry], outs[n_carry:]

        carry, ys = prefetched_scan(
            layer,
            [*body_consts, *consts],
            init,
            handles,
            others,
            length=scan.length,
            reverse=scan.reverse,
            policy=rules.policy,
        )
        return [*carry, *ys]

    # A body that rematerialises layers itself gathers inside its checkpoints (in one flat
    # collective each: remat_layer's); gathered before them, its layer's parameters would
    # be inputs the step's checkpoint saves, with every activation its policy keeps.
    bucketed = any(x.handle.gatherer.bucket for x in xs if isinstance(x, Deferred))
    flat = bucketed and not _rematerialises(scan.body)

    def step(carry, x_slices):
        if flat:
            slices = gather(list(x_slices))  # the layer's leaves in one flat collective
        else:  # each gathered where the step first uses it
            slices = [Deferred(s) if d else s for s, d in zip(x_slices, lazy)]
        outs = run(scan.body, [*consts, *carry, *slices], rules.nested())
        return outs[:n_carry], outs[n_carry:]

    # Rematerialised per step: backward gathers each layer again inside its own loop
    # step (and keeps the step's activations, or what rules.policy saves), instead of a
    # recomputing forward loop stacking every layer's gathered parameters for backward.
    # Stage 2 reads its layer of the local copy, named as gathered too (kept, it would be
    # a second copy of the stack); a body that rematerialises layers itself reads them
    # inside its checkpoints, whose policies an outer one would override.
    if not (rules.scans_only and _rematerialises(scan.body)):
        step = _carry_named(jax.checkpoint(step, policy=saves_no_gathered(rules.policy or _KEEP)))
    carry, ys = jax.lax.scan(
        step, init, scanned, length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    return [*carry, *ys]


def _carry_named(step: Callable) -> Callable:
    """``step`` with each loop step's carry first passed through ``checkpoint_name``.

    Under the checkpoint around a loss whose scans take parameters (:func:`_regathering`), JAX
    saves a step's output carry, not its input, and stages a loop of its own into backward
    that shifts the saved stack by one step to rebuild the inputs: a second stack of every
    step's carry (one activation per layer) alive beside the first. A carry that is a
    primitive's output inside the step is saved as it is, and that loop is not made."""

    def named(carry, x_slices):
        return step([_named(c) for c in carry], x_slices)

    return named


def _named(x: Any) -> Any:
    """``x`` named :data:`CARRY`; an integer or key carry (small) is left as it is."""
    return checkpoint_name(x, CARRY) if jnp.issubdtype(x.dtype, jnp.inexact) else x


def _rematerialises(body: Any) -> bool:
    """Whether a loop ``body`` holds a ``jax.checkpoint`` of its own (e.g. ``nn.remat``)."""
    return any(e.kind is Kind.REMAT for e in walk(body))


def _checkpoint(remat: Remat, operands: list[Any]) -> list[Any]:
    """A ``jax.checkpoint`` region (a layer the user rematerialises) taking deferred
    parameters: run as :func:`jzero.remat_layer` with the region's policy, so the region
    gathers them once its inputs exist and again in backward once its output cotangents
    exist (as a plain checkpoint does on GPU, but also on XLA:CPU, see remat.py)."""
    operands = [x.value() if isinstance(x, Derived) else x for x in operands]
    lazy = [isinstance(x, Deferred) for x in operands]
    handles = [x.handle for x in operands if isinstance(x, Deferred)]
    others = [x for x in operands if not isinstance(x, Deferred)]

    def region(params, *rest):
        params, rest = iter(params), iter(rest)
        return run(remat.body, [next(params) if d else next(rest) for d in lazy], _Gathering())

    return remat_layer(region, policy=remat.policy)(handles, *others)
