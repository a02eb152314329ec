"""The study's record of its runs, one row per run: ``runs.csv`` (every finished run; replaced, atomically,
only when a study finishes) and ``runs.csv.partial`` (the runs of a study in progress, appended one by one as
they finish), so that an interruption loses no finished run and ``--resume`` reuses them."""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .._io import atomic_write_text

__all__ = ["FIELDS", "RunResult", "StudyOutputExists", "append_row", "check_output", "finish_runs", "read_rows",
           "run_key", "skipped_note"]


@dataclass
class RunResult:
    """One training run of one method: its setting (the run's identity, :func:`run_key`) and its scores."""

    phase: str
    method: str
    clients: int
    partition: str
    epsilon: float
    gamma: float
    seed: int
    lr: float
    clip: float
    rounds: int
    accuracy: float | None = None  # on the validation split (tuning) or the test set
    test_accuracy: float | None = None  # tuning runs: the same model on the test set (reused, not selected on)
    worst_node: float | None = None
    epsilon_spent: float | None = None
    rounds_done: int = 0  # rounds trained (the model updated)
    rounds_refused: int = 0  # rounds the budget refused and skipped (charged what they revealed; model kept)
    messages: float | None = None  # messages a participant sent per round, mean over the rounds trained
    seconds: float = 0.0
    note: str = ""


FIELDS = [f.name for f in fields(RunResult)]  # the columns of runs.csv, in this order


def run_key(r: dict | RunResult) -> tuple:
    """A run's identity: ``(phase, method, clients, partition, epsilon, gamma, seed, lr, clip, rounds)``,
    the same for a :class:`RunResult` and its row read back from ``runs.csv``."""
    d = asdict(r) if isinstance(r, RunResult) else r
    return (d["phase"], d["method"], int(d["clients"]), d["partition"], float(d["epsilon"]), float(d["gamma"]),
            int(d["seed"]), float(d["lr"]), float(d["clip"]), int(d["rounds"]))


class StudyOutputExists(ValueError):
    """The output folder holds an earlier study's runs and ``resume`` was not asked for."""


def check_output(out_dir: str | Path, resume: bool) -> None:
    """Raise :class:`StudyOutputExists` if ``out_dir`` holds an earlier study's runs and ``resume`` is
    False (a study never deletes runs it did not make)."""
    for p in (Path(out_dir) / "runs.csv", Path(out_dir) / "runs.csv.partial"):
        if p.exists() and not resume:
            raise StudyOutputExists(
                f"{p} holds runs of an earlier study: pass --resume to reuse them (nothing is deleted), "
                "or choose another --out")


def append_row(path: Path, row: dict) -> None:
    """Append one run's row to ``path`` (the header first if the file is new)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def finish_runs(runs_path: Path, partial: Path, rows: list[dict], old_rows: list[dict]) -> None:
    """Atomically replace ``runs.csv`` by this study's rows followed by every earlier row it did not
    reach (another grid's runs in the same folder are kept), then drop the partial file."""
    keys = {run_key(r) for r in rows}
    kept, seen = [], set()
    for r in old_rows:
        k = run_key(r)
        if k not in keys and k not in seen:
            seen.add(k)
            kept.append(r)
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=FIELDS)
    w.writeheader()
    w.writerows(rows + kept)
    atomic_write_text(runs_path, text.getvalue())
    partial.unlink(missing_ok=True)


def check_columns(path: Path, header: Sequence[str]) -> None:
    """``ValueError`` (one line naming ``path``) unless ``header`` is :data:`FIELDS`: a file with other
    columns is not one this package wrote, and rows appended to it would not line up."""
    if list(header) == FIELDS:
        return
    missing, unknown = [c for c in FIELDS if c not in header], [c for c in header if c not in FIELDS]
    differs = ", ".join([f"lacks {missing}"] * bool(missing) + [f"has unknown {unknown}"] * bool(unknown))
    raise ValueError(f"{path}: not a file of this study's runs: its header {differs or 'has another order'}; "
                     "move it away or choose another --out")


def read_rows(path: Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """The runs recorded in ``path`` (none if it does not exist).

    A last row cut short -- what a study killed while appending it leaves: fewer fields, a value that does
    not parse, or no line end -- is skipped with a warning (``log``) naming the file and line, and removed
    from the file, so that its run is done again and the rows appended next start on a line of their own.
    A malformed row anywhere else raises ``ValueError`` naming the file and line (not what an interrupted
    append leaves: the file was edited or damaged); so does a header other than :data:`FIELDS`."""
    if not path.exists():
        return []
    try:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            records = [(reader.line_num, values) for values in reader if values]
    except (csv.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a CSV file of runs ({exc})") from None
    if header is None:
        return []
    with path.open("rb") as f:  # csv.writer ends every row with a line end: a file without one was cut
        f.seek(max(f.seek(0, os.SEEK_END) - 1, 0))
        terminated = f.read(1) == b"\n"
    warn = log or _stderr
    if not records and not terminated:  # the header itself was cut: no run was recorded
        warn(f"warning: {path}: only a cut header line, as a study stopped while writing its first run leaves "
             "it: removed")
        path.unlink()
        return []
    check_columns(path, header)
    rows = []
    for k, (line, values) in enumerate(records):
        last = k == len(records) - 1
        try:
            row = parse_row(header, values)
            if last and not terminated:
                raise ValueError("no line end")
        except ValueError as exc:
            if not last:
                raise ValueError(f"{path}, line {line}: not a complete run ({exc}); correct or remove that "
                                 "row") from None
            warn(f"warning: {path}, line {line}: the last row is incomplete ({exc}), as a study stopped while "
                 "writing it leaves it: skipped, and that run is done again")
            _rewrite_rows(path, header, [v for _, v in records[:-1]])
            continue
        rows.append(row)
    return rows


def parse_row(header: list[str], values: list[str]) -> dict:
    """One row of ``runs.csv`` as a dict, its scores as floats (None when empty); ``ValueError`` saying what
    is wrong with a row that is not a complete run."""
    if len(values) != len(header):
        raise ValueError(f"{len(values)} fields, the header has {len(header)}")
    row = dict(zip(header, values))
    try:
        for k in ("accuracy", "test_accuracy", "worst_node", "epsilon_spent"):
            if k in row:
                row[k] = float(row[k]) if row[k] not in ("", "None") else None
        run_key(row)  # the run's identity: every field of it present and parseable
        float(row.get("seconds") or 0.0)
    except KeyError as exc:
        raise ValueError(f"no {exc.args[0]!r} column") from None
    return row


def _rewrite_rows(path: Path, header: list[str], records: list[list[str]]) -> None:
    """Replace ``path`` atomically by ``header`` and ``records`` (fields written back as they were read)."""
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(header)
    w.writerows(records)
    atomic_write_text(path, text.getvalue())


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def skipped_note(row: dict) -> str:
    """`` (k of R rounds skipped: refused by the budget)`` for a run whose budget refused rounds, else ""."""
    refused = row.get("rounds_refused")
    if refused in (None, "", 0, "0"):
        return ""
    return f" ({int(refused)} of {row['rounds']} rounds skipped: refused by the budget)"
