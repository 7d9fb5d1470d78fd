"""The decode op: :mod:`.spec` (``DecodeSpec``, slot checks), :mod:`.reference` (the token-serial
decode) and :mod:`.api` (``gdn2_decode``, ``init_state_pool``)."""
