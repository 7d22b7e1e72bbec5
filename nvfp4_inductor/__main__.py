"""`python -m nvfp4_inductor COMMAND`: `quantize` (a Hugging Face model folder -> an NVFP4
checkpoint, streamed tensor group by tensor group) and `check` (this package on this device,
against the reference)."""

import argparse
import sys

from nvfp4_inductor import selfcheck
from nvfp4_inductor.io import export


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default: sys.argv[1:]) and run the command; -> the exit status."""
    parser = argparse.ArgumentParser(prog="python -m nvfp4_inductor", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export.add_arguments(commands.add_parser("quantize", help=export.__doc__.splitlines()[0],
                                             description=export.__doc__))
    selfcheck.add_arguments(commands.add_parser("check", help=selfcheck.__doc__.splitlines()[0],
                                                description=selfcheck.__doc__))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
