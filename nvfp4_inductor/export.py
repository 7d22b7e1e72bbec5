"""Quantize a Hugging Face model folder to an NVFP4 checkpoint, streaming (not yet implemented)."""


def add_arguments(parser) -> None:
    parser.set_defaults(run=main)


def main(args) -> int:
    raise NotImplementedError
