"""Every ```python block of the README runs, in order, in one namespace (in a temp directory)."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_snippets_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["again"].estimate.shape == (8,)
    assert (tmp_path / "ledger.json").exists() and namespace["ledger"].rounds == 3
