"""Checkpoints in other tools' formats (ModelOpt, compressed-tensors, torchao), transformers'
from_pretrained / save_pretrained, and the streaming quantizer of model folders."""
