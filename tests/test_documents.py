"""The documents a newcomer reads: each within its budget, and no comparative figure typed by hand.
A decimal figure of the hand-written text of COMPARISON.md, RESULTS.md, PERFORMANCE.md and the
README's results must be a figure of a generated block of the same document or of a committed
log under docs/data/; the generated blocks themselves are checked against the logs by
test_provenance.py."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"README.md": 350, "docs/COMPARISON.md": 250, "docs/RESULTS.md": 250,
           "docs/PERFORMANCE.md": 200}
BLOCK = re.compile(r"<!-- ([\w.]+):(\w+) -->\n(.*?)<!-- /\1 -->", re.S)
FIGURE = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?![\d.])")


@pytest.mark.parametrize("path, budget", BUDGETS.items())
def test_each_document_is_within_its_budget(path, budget):
    assert len((ROOT / path).read_text().splitlines()) <= budget, path


def hand_written(text):
    """The text outside generated blocks, code blocks and inline code, with dates removed."""
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\d{4}-\d{2}-\d{2}(T[0-9:]+Z)?", "", text)


def logged_text():
    data = ROOT / "docs" / "data"
    return "".join(p.read_text() for p in sorted(data.iterdir()) if p.suffix in (".jsonl", ".txt"))


def results_text(path):
    """The results a document tells: README.md's "Results at a glance" and quick start result;
    COMPARISON.md, RESULTS.md and PERFORMANCE.md whole."""
    text = (ROOT / path).read_text()
    if path != "README.md":
        return text
    glance = text.split("## Results at a glance")[1].split("\n## ")[0]
    return glance + text.split("**Result**")[1].split("\n## ")[0]


@pytest.mark.parametrize("path", BUDGETS)
def test_every_figure_of_the_hand_written_text_is_generated_or_logged(path):
    text = results_text(path)
    generated = "".join(body for _, _, body in BLOCK.findall(text))
    known = {m.lstrip("+-") for m in FIGURE.findall(generated + logged_text())}
    typed = [m for m in FIGURE.findall(hand_written(text)) if m.lstrip("+-") not in known]
    assert typed == [], f"{path}: figures typed by hand, in no generated block or log line: {typed}"


def test_the_rule_catches_a_typed_figure():
    """The check itself: a figure in prose that no block or log holds is found."""
    text = ("EsViT adds 0.987654 points over DINO.\n"
            "<!-- compare.py:x -->\n12.345\n<!-- /compare.py -->\n")
    known = set(FIGURE.findall(logged_text()))
    found = [m for m in FIGURE.findall(hand_written(text)) if m not in known]
    assert found == ["0.987654"] and "12.345" not in hand_written(text)


def test_errors_tell_the_current_behaviour_and_the_drivers_apart():
    text = (ROOT / "docs" / "ERRORS.md").read_text()
    assert not re.search(r"\bbefore: |; now\b", text)
    assert "\n## The experiment drivers\n" in text
    table1 = text.split("## The experiment drivers")[0]
    assert "extras/experiments/" not in table1
