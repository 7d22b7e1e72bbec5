"""Inductor lowerings for the nvfp4:: ops (the `backend="nvfp4"` work; not implemented yet)."""
