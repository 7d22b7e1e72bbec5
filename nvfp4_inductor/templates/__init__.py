"""Triton templates of Inductor's NVFP4 GEMM choices: the template bodies live in `*.py.jinja`
files named after the template; `nvfp4_inductor.lowerings` builds the TritonTemplate objects."""

from pathlib import Path


def load_template(name: str) -> str:
    """The Jinja source of templates/<name>.py.jinja."""
    return (Path(__file__).parent / f"{name}.py.jinja").read_text()
