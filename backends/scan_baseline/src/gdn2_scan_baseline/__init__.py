"""The scan_baseline backend of gdn2 (see backend.py)."""
