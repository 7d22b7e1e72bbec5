"""@triton.jit building blocks of the NVFP4 kernels, imported by kernels and templates alike:
`common` (the format's rounding and layouts), `mma` (the register-fed mainloop), `mainloops` (the
decode, the tl.dot / wgmma / block-scaled mainloops and the one dispatch among them), `epilogue`
(global scales and bias, the split-K sum, the gated MLP's silu(gate) * up). Nothing here launches
a kernel or decides which one runs (kernels/plan.py does)."""
