"""The README's Quickstart runs as written (on the CPU here; the same code picks CUDA on a GPU)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_quickstart_runs_as_written(capsys):
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md Quickstart", "exec"), namespace)  # noqa: S102  (the README's own code)
    assert namespace["report"].layers == 2 * 7
    assert namespace["logits"].isfinite().all() and namespace["logits"].shape == (1, 12, 1000)
    assert "converted" in capsys.readouterr().out
