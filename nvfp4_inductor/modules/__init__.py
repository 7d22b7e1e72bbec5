"""The NVFP4 layers (NVFP4Linear, NVFP4Experts) and the conversion of a model's layers to them."""
