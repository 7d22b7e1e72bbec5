"""The backend's FX graph passes: linears to NVFP4 ops (linear.py), transformers experts to the
grouped ops (experts.py), RMSNorm fused into what reads it (norms.py); fx.py holds the matchers
they share."""
