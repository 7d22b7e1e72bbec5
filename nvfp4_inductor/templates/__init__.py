"""The Triton templates the lowerings render (Jinja sources beside this file)."""

from pathlib import Path

__all__ = ["source"]


def source(name: str) -> str:
    """The text of the template file `name` in this folder."""
    return (Path(__file__).parent / name).read_text()
