"""Attention methods, one file each. ``approx.registry`` imports every module here not starting with ``_``
(each registers its method); the ``_``-modules are building blocks shared by several methods."""
