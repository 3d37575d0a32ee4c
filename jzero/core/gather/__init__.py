"""Where stage 3 gathers: each parameter where the traced loss first uses it, scans per
layer (``autogather``); a layer loop gathering one layer ahead (``prefetch``); a
rematerialised layer that gathers its own parameters (``remat``). All send through
:mod:`jzero.core.comm`."""
