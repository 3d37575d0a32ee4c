"""Every use of JAX internals in jzero, and its one jaxpr interpreter.

jzero re-runs traced jaxprs (stage 3's deferred gathers, batch-axis aliases, the
offloaded update's split and chunks), reads what remat policies are shown, and explains a
collective over an axis the step lacks. That needs parts of JAX outside its public API:
``jax.extend.core`` (jaxpr types, primitives), two parts of ``jax._src`` (shard_map's
varying-axes check flag, the coordination service), primitive parameter names, the operand order of
higher-order primitives and the text of one JAX error. They are all here and nowhere else
in jzero (``tests/project/test_structure.py`` checks it); the rest of jzero uses public JAX.

This package makes no stability promises: its names and behaviour may change in any
release, following whatever the installed JAX needs. ``tests/internal/test_jax_internals.py`` names
each internal it relies on and fails, naming the internal and the JAX version, when a JAX
release changes one.

Modules:

- :mod:`.primitives`: which primitive is which (:class:`~.primitives.Kind`), the one
  spelling of the mesh axes a value varies over, and what remat policies read from a
  primitive's parameters.
- :mod:`.equation`: :class:`~.equation.Equation`, one traced equation as jzero's rules read
  it, with views of the higher-order primitives' parameters (call, remat, scan, cond,
  while, custom_vjp) and walks over nested jaxprs.
- :mod:`.interpret`: the interpreter: :func:`~.interpret.run` and
  :func:`~.interpret.evaluate` evaluate a jaxpr under a feature's
  :class:`~.interpret.Interpreter`; :func:`~.interpret.rebind` re-applies a higher-order
  primitive with its bodies evaluated under the same rules;
  :func:`~.interpret.run_in_regions` evaluates ranges of equations as calls of their own
  (an unrolled model's layers) and :func:`~.interpret.narrowest_cut` finds where the
  fewest bytes cross between two equations.
- :mod:`.unbound_axes`: which collective of a function names an axis a step lacks.
- :mod:`.coordination`: JAX's coordination-service key-value store (multi-process
  progress, :mod:`jzero.distributed`).
- :mod:`.host_compute`: a host computation inside a device program (``compute_on``).
- :mod:`.moved`: what every reader raises when an internal moved
  (:class:`~.moved.InternalMoved`), and the features' one warning when they fall back.
"""
