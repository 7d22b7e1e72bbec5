"""Check this package on this device against the reference (not yet implemented)."""


def add_arguments(parser) -> None:
    parser.set_defaults(run=main)


def main(args) -> int:
    raise NotImplementedError
