"""The model features of the operator, one module each, as the core implements them for every
backend:

- :mod:`~gdn2core.features.segments`: packed sequences (``segment_ids``, ``cu_seqlens``):
  validation and the token layouts (starts, sequence index) the reference and baselines use;
- :mod:`~gdn2core.features.activations`: the fused activations (gates, L2 norm): validation of
  the gate parameters and the XLA path for backends that do not fuse them;
- :mod:`~gdn2core.features.gva`: grouped value heads, resolved before any backend runs;
- :mod:`~gdn2core.ops.dispatch`: one call from validated inputs to a backend's result.
"""
