"""The delta-rule family on the GDN-2 operator, with fla's signatures: Kimi Delta Attention
(:func:`chunk_kda`) and Gated DeltaNet (:func:`chunk_gated_delta_rule`), their recurrent
(decoding) forms (recurrent.py: ``fused_recurrent_kda``, ``fused_recurrent_gated_delta_rule``),
their independent token-serial references, and the conversion of their arguments to the GDN-2
call (convert.py)."""
