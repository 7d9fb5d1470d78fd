"""Multi-device GDN-2: batch/head sharding and context parallelism through ``shard_map``.

How a call finds its mesh (:func:`gdn2core.sharding.plan.resolve_plan`)
------------------------------------------------------------------------
The public ops (``gdn2_forward``, ``gdn2_forward_trainable``) take keyword-only arguments
``mesh=``, ``batch_axes=``, ``head_axes=`` and ``context_axis=``. The mesh is, in this order:

1. ``mesh=`` (a ``Mesh`` or ``AbstractMesh``);
2. the mesh of q's sharding as JAX exposes it: the ``NamedSharding`` of a concrete array (eager
   call), or, inside ``jax.jit``, the sharding in q's type (``jax.typeof(q).sharding``), which
   carries the mesh of the jitted function's arguments;
3. only when some axis keyword is given: JAX's mesh context (``with jax.set_mesh(mesh):``).
   A mesh context alone, with unsharded arguments and no keyword, does not route (plain path).

The roles of the mesh axes: the keywords when given; otherwise q's ``PartitionSpec`` (dim 0 ->
batch, dim 2 -> heads), which JAX shows for a concrete array and, under jit, for axes of type
``Explicit`` (the default of ``jax.make_mesh``). Axes whose role is not visible (an ``Auto`` mesh
under jit, or ``mesh=`` without axes) are assigned batch first, then heads, while the sizes divide;
pass ``batch_axes``/``head_axes`` to match your layout exactly (a mismatch is still correct, XLA
then reshards the inputs). A sharded time axis without ``context_axis`` is refused, so is a sharded
channel axis. A mesh of one device, or a plan that splits nothing, runs the plain path; so does a
call inside the caller's own ``shard_map`` (its manual axes are never re-split).

What runs (:func:`gdn2core.sharding.run.sharded_call`)
------------------------------------------------------
The selected backend's ``forward`` / ``forward_trainable`` inside ``jax.shard_map``, once per
device, on its ``(B/nb, T/P, H/nh)`` shard, for every backend alike (a Pallas kernel cannot be
partitioned by XLA). Only the mesh axes the plan uses become manual; any other mesh axis stays
automatic (inputs replicated over it are neither gathered nor their gradients all-reduced).
Batch/head sharding has no collective at all, forward or backward; context parallelism
(``context_axis=``, ``T % P == 0`` required, else ``ValueError``) all-gathers per-shard state
summaries only, see :mod:`gdn2core.sharding.run`. Backends may set a class attribute
``shard_map_check_vma = True`` to have their per-shard call type-checked by shard_map (off by
default: backends need not type their scan carries for shard_map).
"""

from gdn2core.sharding.plan import ShardPlan, resolve_plan
from gdn2core.sharding.run import combine_summaries, shard_summaries, sharded_call

__all__ = ["ShardPlan", "combine_summaries", "resolve_plan", "shard_summaries", "sharded_call"]
