"""Every python snippet of docs/llm.md runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "llm.md"


def test_llm_doc_snippets_run(capsys) -> None:  # noqa: ANN001
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "attention is" in out and "padding" in out
