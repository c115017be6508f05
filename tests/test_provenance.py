"""What the published numbers rest on: the generators refuse to write from a missing, empty or
unreadable log; every figure of a generated block is a logged value (or computed from logged
values); a gain over random initialisation pairs a row only with its own network."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/COMPARISON.md", "docs/RESULTS.md"]


@pytest.fixture
def copy(tmp_path):
    """The scripts and the generated documents, copied: a generator that writes writes there."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    for path in [*ROOT.glob("*.py"), ROOT / "README.md"]:
        shutil.copy(path, repo / path.name)
    shutil.copytree(ROOT / "extras", repo / "extras", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs" / "data", repo / "docs" / "data")
    for path in (ROOT / "docs").glob("*.md"):
        shutil.copy(path, repo / "docs" / path.name)
    return repo


def run(repo, *args):
    return subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=300)


def bad_logs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "log.txt").write_text('{"epoch": 0, "loss": 3.2, "lr": 0.001}\n{"epoch": 1, "loss": 2.9, "lr": 0.002}\n')
    (tmp_path / "train.txt").write_text("[12:00:00] epoch 0: loss 3.2\n")
    return {"missing": tmp_path / "no_such_log.jsonl", "empty": tmp_path / "empty.jsonl",
            "binary": tmp_path / "binary.bin", "training log": tmp_path / "log.txt", "text": tmp_path / "train.txt",
            "folder": tmp_path}


@pytest.mark.parametrize("script", ["extras/compare.py", "extras/results.py"])
@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "training log", "text", "folder"])
def test_table_refuses_a_log_it_cannot_read_and_writes_nothing(tmp_path, copy, script, kind):
    before = {path: (copy / path).read_bytes() for path in DOCS}
    r = run(copy, script, "--table", "--log", str(bad_logs(tmp_path)[kind]))
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr[-2000:]
    assert {path: (copy / path).read_bytes() for path in DOCS} == before


@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "training log", "text"])
def test_curves_refuse_a_log_that_is_not_a_comparison_log(tmp_path, copy, kind):
    r = run(copy, "extras/visualize.py", "curves", "--log", str(bad_logs(tmp_path)[kind]), "--output",
            str(tmp_path / "curves.png"))
    assert r.returncode != 0 and not (tmp_path / "curves.png").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr[-2000:]
