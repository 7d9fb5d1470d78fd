"""The pallas_tpu backend of gdn2 (see backend.py)."""
