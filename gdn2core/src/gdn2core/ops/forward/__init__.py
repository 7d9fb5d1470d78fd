"""The chunked GDN-2 operator: :mod:`.spec` (``OpSpec``), :mod:`.reference` (the token-serial
ground truth) and :mod:`.api` (``gdn2_forward``, ``gdn2_forward_trainable``)."""
