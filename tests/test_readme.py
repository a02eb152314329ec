"""The README works as written: every ```python block runs, in order, in one namespace (the ledger
snippet twice, as a user re-running it would), and every command line of the CLI section parses."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
EXAMPLE_README = ROOT / "examples" / "mnist_logreg" / "README.md"


def _run_snippets(blocks):
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    return namespace


def test_readme_python_snippets_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    first = _run_snippets(blocks)
    assert first["again"].estimate.shape == (8,)
    assert Path(first["path"]).exists() and first["ledger"].rounds == 3
    # the ledger snippet again, as a user re-running it would: the ledger it wrote does not get in the way
    ledger_block = next(b for b in blocks if "PrivacyLedger(" in b)
    second = _run_snippets([ledger_block])
    assert second["ledger"].rounds == 3 and second["path"] != first["path"]


def _bash_lines(text):
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        yield from (line for line in block.replace("\\\n", " ").splitlines() if line.strip())


def test_readme_command_lines_parse():
    from flwr_inca.cli import build_parser

    parser = build_parser()
    lines = [line.split("#")[0] for line in _bash_lines(README.read_text()) if line.startswith("flwr-inca ")]
    assert len(lines) >= 6
    for line in lines:
        try:
            parser.parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"README command does not parse: {line}")


def test_example_readme_leads_with_the_route_that_works_offline():
    text = EXAMPLE_README.read_text()
    first = next(_bash_lines(text))
    assert first.startswith("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run .")
    assert "pkill" not in text and "pkill" not in README.read_text()  # stop your SuperLink, not everyone's
    quick = [line for line in _bash_lines(README.read_text()) if "flwr run" in line]
    assert quick and "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run ." in quick[0]
