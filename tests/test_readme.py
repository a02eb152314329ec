"""The README and the docs work as written: every ```python block of the README runs, in order, in one
namespace (the ledger snippet twice, as a user re-running it would); every `flwr-inca` command line in the
README and docs parses; every relative link resolves; the worked example prints what docs/privacy.md
shows."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
EXAMPLE_README = ROOT / "examples" / "mnist_logreg" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


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


def _command_lines(path):
    return [re.sub(r"\s+#.*$", "", line.strip()) for line in _bash_lines(path.read_text())
            if line.strip().startswith("flwr-inca ")]


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_command_lines_parse(doc):
    """Every documented command a reader would copy (README, results, reproduction, simulation, privacy...)."""
    from flwr_inca.cli import build_parser

    parser = build_parser()
    for line in _command_lines(doc):
        try:
            parser.parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"{doc.name}: command does not parse: {line}")


def test_command_lines_are_found():  # the pattern still finds them
    assert len(_command_lines(README)) >= 6
    assert sum(len(_command_lines(doc)) for doc in DOCS) >= 40


@pytest.mark.parametrize("doc", [README, EXAMPLE_README, *DOCS, *sorted((ROOT / "benchmarks").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    links = [link for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
             if not re.match(r"[a-z]+:", link)]
    missing = [link for link in links if not (doc.parent / link).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_worked_example_prints_what_the_docs_show():
    """docs/privacy.md quotes the output of docs/worked_example.py: the script and the quote agree."""
    # BLAS threads: pinned in os.environ by conftest.py, which the script inherits
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "worked_example.py")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    text = (ROOT / "docs" / "privacy.md").read_text()
    section = text[text.index("## Worked example"):]
    quoted = re.search(r"```\n(.*?)```", section, flags=re.DOTALL).group(1)
    assert run.stdout.strip() == quoted.strip()


def test_example_readme_leads_with_the_route_that_works_offline():
    text = EXAMPLE_README.read_text()
    first = next(_bash_lines(text))
    assert first.startswith("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run .")
    assert "pkill" not in text and "pkill" not in README.read_text()  # stop your SuperLink, not everyone's
    quick = [line for line in _bash_lines(README.read_text()) if "flwr run" in line]
    assert quick and "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run ." in quick[0]
