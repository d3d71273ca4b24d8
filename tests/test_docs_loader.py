"""The python snippets of docs/loader.md run, in order, in one namespace (one
process: the loader passes batches through). The Lightning sketch is skipped:
Lightning is not a dependency."""

from __future__ import annotations

import re
import threading
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "loader.md"


def test_loader_doc_snippets_run(capsys) -> None:  # noqa: ANN001
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    runnable = [b for b in blocks if "import lightning" not in b]
    assert len(runnable) == 3 and len(blocks) == 4
    namespace: dict = {}
    for i, code in enumerate(runnable):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["0", "1"]
    assert namespace["state"] == {"epoch": 1, "consumed": 1, "world_size": 1}
    assert [b.actual_batch_size for b in namespace["rest"]] == [4, 3]  # the rest of epoch 1
    assert namespace["sizes"] == [(4, 4, 7), (4, 4, 7), (4, 3, 7)]  # TokenBatch: the last one padded
    assert not [t for t in threading.enumerate() if t.name.startswith("balancer-loader")]
