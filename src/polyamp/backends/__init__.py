"""Deprecated: the framework modules moved to ``polyamp.torch``, ``polyamp.tensorflow``,
``polyamp.jax`` and ``polyamp.mxnet`` (one front end per framework; docs/ARCHITECTURE.md).
``polyamp.backends.jax``, ``.jax_autocast`` and ``.tensorflow`` still import, with a
DeprecationWarning, and hand out the same objects."""
