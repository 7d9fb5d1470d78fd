"""Grouped value heads (GVA), resolved by the core before any backend runs.

q, k have ``H`` heads; v, w, the state, h0, h_final and o have ``HV = G * H``; value head ``j``
reads key head ``j // G`` (fla's convention). b and g (and ``A_log``, ``dt_bias``) have ``H`` or
``HV`` heads. A backend only ever sees a plain call (``value_heads == gate_heads == heads``):

- b, g with ``H`` heads (:func:`group_call`, "shared keys"): the ``G`` value heads of a key head
  are one head of ``G * dv`` value channels. Every value column of the state evolves
  independently under the same key-side operators (decay, erase, ``A_kk``, WY inverse), so the
  backend computes all of those once per key head. v, w ``(B, T, HV, dv) -> (B, T, H, G*dv)``
  is a free reshape; h0 ``(L, HV, dk, dv) -> (L, H, dk, G*dv)`` a small transpose, undone on
  h_final; o ``(B, T, H, G*dv) -> (B, T, HV, dv)`` is free.
- b, g with ``HV`` heads ("repeated keys"): q and k are repeated to ``HV`` heads
  (``jnp.repeat``; their gradients sum over the group) and the call is plain with ``H' = HV``.
  A backend with ``Capabilities.grouped_keys`` gets them unrepeated instead (``H`` heads, the
  plain spec's ``key_groups = G``) and reads key head ``j // G`` for head ``j`` itself: no
  ``(B, T, HV, dk)`` copies in HBM (:func:`group_call` with ``repeat_keys=False``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn2core.ops.forward.spec import OpSpec


def resolve_spec(spec: OpSpec) -> OpSpec:
    """The spec of the plain call a grouped call becomes (unchanged without GVA).

    Args:
        spec: the call's spec.

    Returns:
        A spec with ``value_heads == gate_heads == heads``.
    """
    G = spec.groups
    if G == 1:
        return spec
    if spec.gate_heads == spec.heads:  # shared keys: G value heads -> one head of G * dv
        return dataclasses.replace(spec, dv=G * spec.dv, value_heads=spec.heads)
    return dataclasses.replace(spec, heads=spec.value_heads)  # repeated keys


def group_call(spec: OpSpec, q, k, v, w, h0, repeat_keys: bool = True):
    """The inputs of the plain call of a grouped call (see the module docstring).

    Args:
        spec: the call's spec (GVA or not).
        q, k: ``(B, T, H, dk)``; v, w: ``(B, T, HV, dv)``; h0: ``(L, HV, dk, dv)``.
        repeat_keys: repeat q, k to the value heads when b, g have ``HV`` heads (False: the
            backend reads them grouped, ``Capabilities.grouped_keys``).

    Returns:
        ``(q, k, v, w, h0)`` of the plain call (b, g and the gate parameters need no change).
    """
    G = spec.groups
    if G == 1:
        return q, k, v, w, h0
    if spec.gate_heads == spec.heads:
        bsz, seq, heads, dv = spec.batch, spec.seq_len, spec.heads, spec.dv
        v = v.reshape(bsz, seq, heads, G * dv)  # [B, T, H, G*dv]
        w = w.reshape(bsz, seq, heads, G * dv)  # [B, T, H, G*dv]
        h0 = group_state(h0, G)  # [L, H, dk, G*dv]
        return q, k, v, w, h0
    if not repeat_keys:
        return q, k, v, w, h0
    return (*repeat_keys_of(q, k, G), v, w, h0)


def repeat_keys_of(q: jax.Array, k: jax.Array, G: int) -> tuple[jax.Array, jax.Array]:
    """q, k ``(B, T, H, dk)`` repeated to ``(B, T, G H, dk)``: head ``j`` is key head ``j // G``."""
    return jnp.repeat(q, G, axis=2), jnp.repeat(k, G, axis=2)  # [B, T, HV, dk]


def ungroup_outputs(spec: OpSpec, o: jax.Array, h_final: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The outputs of a grouped call from those of its plain call.

    Args:
        spec: the grouped call's spec.
        o: the plain call's o; h_final: its final state.

    Returns:
        ``(o, h_final)``: ``(B, T, HV, dv)`` and ``(L, HV, dk, dv)``.
    """
    if spec.groups == 1 or spec.gate_heads != spec.heads:
        return o, h_final
    o = o.reshape(spec.batch, spec.seq_len, spec.value_heads, spec.dv)
    return o, ungroup_state(spec, h_final)


def ungroup_state(spec: OpSpec, h: jax.Array) -> jax.Array:
    """States of a grouped call from those of its plain call (the inverse of the h0 mapping).

    Args:
        spec: the grouped call's spec.
        h: states ``(..., H', dk, dv')`` of the plain call (h_final, chunk states).

    Returns:
        ``(..., HV, dk, dv)``.
    """
    G = spec.groups
    if G == 1 or spec.gate_heads != spec.heads:
        return h
    *lead, heads, dk, _ = h.shape
    h = h.reshape(*lead, heads, dk, G, spec.dv)  # [..., H, dk, G, dv]
    h = jnp.moveaxis(h, -2, -3)  # [..., H, G, dk, dv]
    return h.reshape(*lead, heads * G, dk, spec.dv)


def group_state(h: jax.Array, G: int) -> jax.Array:
    """States of a grouped call in its plain call's view (the inverse of :func:`ungroup_state`;
    a backend that writes states in the caller's layout hands them back through it, and XLA
    cancels the pair): value head ``h*G + i`` is columns ``i*dv:(i+1)*dv`` of key head h.

    Args:
        h: states ``(..., HV, dk, dv)`` (h0, chunk states).
        G: value heads per key head.

    Returns:
        ``(..., HV / G, dk, G * dv)``.
    """
    *lead, hv, dk, dv = h.shape
    h = h.reshape(*lead, hv // G, G, dk, dv)  # [..., H, G, dk, dv]
    h = jnp.moveaxis(h, -3, -2)  # [..., H, dk, G, dv]
    return h.reshape(*lead, hv // G, dk, G * dv)
