"""The test ledger (docs/data/test_ledger.jsonl): every evaluation on a test split is appended there
by its driver before it starts, a second one of the same row, seed and budget is refused without a
reason, the ledger is never rewritten, and the documents count the uses from it."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "extras" / "experiments"))
import compare  # noqa: E402
import compare_tables  # noqa: E402
import provenance  # noqa: E402
import split_ledger  # noqa: E402
import quickstart  # noqa: E402
import results  # noqa: E402

LEDGER = ROOT / "docs" / "data" / "test_ledger.jsonl"


@pytest.fixture(autouse=True)
def ledger_elsewhere(tmp_path, monkeypatch):
    """The drivers run here append to a ledger of their own, never to the committed one."""
    monkeypatch.setattr(split_ledger, "LEDGER", tmp_path / "test_ledger.jsonl")
    monkeypatch.setattr(provenance.os, "chdir", lambda path: None)


def test_the_ledger_is_only_appended_to():
    """The committed ledger begins with its committed prefix, byte for byte: a line once written is
    never changed or removed (a new copy of the prefix is committed only by appending)."""
    prefix = (ROOT / "tests" / "data" / "test_ledger_prefix.jsonl").read_text()
    assert prefix and LEDGER.read_text().startswith(prefix)
    entries = split_ledger.read_ledger(LEDGER)
    assert {e["kind"] for e in entries} <= {"use", "result", "reason"}
    ids = [e["id"] for e in entries if e["kind"] == "use"]
    assert len(ids) == len(set(ids))
    assert {e["id"] for e in entries if e["kind"] != "use"} <= set(ids)
    for e in entries:
        if e["kind"] == "use":
            assert set(split_ledger.LEDGER_KEY) <= set(e) and e["command"] and e["reason"]


def test_a_reason_line_rewords_a_use_and_the_tables_show_the_last_wording(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    use_id = split_ledger.record_test_use(ledger, USE, reason="first wording")
    provenance.append_line(ledger, {"kind": "reason", "id": use_id, "reason": "second wording"})
    [shown] = split_ledger.uses_with_results(split_ledger.read_ledger(ledger))
    assert shown["reason"] == "second wording"


def test_the_ledger_holds_the_past_reconstructed_and_the_withdrawn_lines():
    """The history told: the three 1,600-step test lines that were deleted are in the ledger,
    marked withdrawn, and back in the log; vit_dino and vit_esvit went to test twice at seed 0 with
    no reason recorded (a later use, for DINO's four k, gives its reason)."""
    uses = [e for e in split_ledger.read_ledger(LEDGER) if e["kind"] == "use"]
    withdrawn = {
        (e["row"], e["result"]) for e in uses if e.get("withdrawn") and e["budget"] == 1600
    }
    assert withdrawn == {("swin_glsd_geometric", 80.67), ("vit_dino", 66.47), ("vit_esvit", 68.16)}
    for row in ("vit_dino", "vit_esvit"):
        key = ("compare.py", "fashion_mnist", row, 0, 1600, "row")
        past, later = split_ledger.test_uses(uses, key)[:2], split_ledger.test_uses(uses, key)[2:]
        assert [e.get("reconstructed") for e in past] == [True, True]
        assert all(not e.get("reconstructed") and "four k" in e["reason"] for e in later)
    log = provenance.read_log(ROOT / "docs" / "data" / "compare_32px.jsonl")
    assert {(r["row"], r["knn_top1"]) for r in log if r.get("withdrawn")} == withdrawn
    shown = compare_tables.current(log)
    assert not any(r.get("withdrawn") for r in shown)  # in the log, not in the tables
    blocks = compare.generated_blocks(log)
    assert all(
        f"| compare.py | fashion_mnist | {row} | 0 | 1600 | {top1} |" in blocks["withdrawn"]
        for row, top1 in withdrawn
    )
    for value in (38.4, 79.2, 84.59):           # the pixel values taken out of the log: listed too
        assert f"| pixels | 0 | 400 | {value} |" in blocks["withdrawn"]
    assert "| results.py | fashion_mnist | pixels | 0 | — | 84.59 |" in results.generated_blocks(
        provenance.read_log(ROOT / "docs" / "data" / "results_32px.jsonl"))["withdrawn"]


def test_the_ledger_holds_the_uses_of_the_deleted_logs_and_their_first_commits():
    """The 19 test evaluations of the deleted 64 px log and the quick start's two results that the
    README published without a log line are in the ledger; a reconstructed use names the first
    commit of its line under the log's first name (the rename to docs/data/ is no first commit)."""
    uses = [e for e in split_ledger.read_ledger(LEDGER) if e["kind"] == "use"]
    sixty_four = [e for e in uses if e["data"] == "fashion_mnist_64px"]
    assert len(sixty_four) == 19 and all(e.get("withdrawn") for e in sixty_four)
    quick = [e for e in uses if e["driver"] == "quickstart.py" and e["data"] == "fashion_mnist"
             and e["row"] == "dino trained on fashion_mnist"]
    assert sorted(e["result"] for e in quick) == [56.56, 56.58, 58.46, 58.54, 58.54]
    assert not any("first in commit c3056d5" in (e.get("from") or "") for e in uses)
    readme = (ROOT / "README.md").read_text()
    assert "58.54% (test use 5 of 5)" in readme


def fake_compare(monkeypatch, ledger, seen):
    """compare.py's evaluation replaced by one that records what the ledger held when it began."""

    def fake_call(self, args, log_name):
        self.wall_seconds["train"] = self.cpu_seconds["train"] = 5.0
        (self.out / "args.json").write_text(json.dumps({"precision": "bf16", "epochs": 1}))
        (self.out / "log.txt").write_text(json.dumps({"epoch": 0, "peak_memory_mb": 10}) + "\n")

    def fake_knn(self, *args, **kwargs):
        seen.append([e for e in split_ledger.read_ledger(ledger) if e["kind"] == "use"])
        return {"10": 61.0, "20": 60.0, "100": 58.0, "200": 57.0}

    monkeypatch.setattr(compare.Evaluator, "call", fake_call)
    monkeypatch.setattr(compare.Evaluator, "knn", fake_knn)
    for name in ("correspondence", "collapse"):
        monkeypatch.setattr(compare.Evaluator, name, lambda self, *a, **k: {})
    monkeypatch.setattr(
        compare.provenance, "checkpoint_signature", lambda weights: {"arch": "vit_pico"}
    )


def test_compare_appends_before_evaluating_and_refuses_an_unexplained_second_use(
    tmp_path, monkeypatch, capsys
):
    ledger, seen = tmp_path / "ledger.jsonl", []
    fake_compare(monkeypatch, ledger, seen)

    def main(log, *extra):
        argv = [
            "compare.py",
            "--phase",
            "test",
            "--rows",
            "vit_dino",
            "--seeds",
            "0",
            "--curve_seeds",
            "--skip_linear",
            "--log",
            str(tmp_path / log),
            "--work_dir",
            str(tmp_path / log / ".." / f"work_{log}"),
            "--ledger",
            str(ledger),
            *extra,
        ]
        monkeypatch.setattr(sys, "argv", argv)
        compare.main()

    main("a.jsonl")
    assert len(seen) == 1 and [e["row"] for e in seen[0]] == ["vit_dino"]  # written before the k-NN
    use = seen[0][0]
    assert (use["seed"], use["budget"], use["reason"]) == (0, 400, "first use")
    assert use["command"].startswith("python dino.py") and use["commit"] is not None
    logged = provenance.read_log(tmp_path / "a.jsonl")[0]
    assert logged["test_use"] == use["id"]
    assert split_ledger.uses_with_results(split_ledger.read_ledger(ledger))[0]["result"] == 60.0
    before = ledger.read_text()
    with pytest.raises(SystemExit) as stop:  # another log, the same row and budget
        main("b.jsonl")
    assert str(stop.value).startswith("error: the test split was evaluated for vit_dino seed 0")
    assert len(seen) == 1 and ledger.read_text() == before and not (tmp_path / "b.jsonl").exists()
    main("b.jsonl", "--reason", "the checkpoint was lost")
    uses = [e for e in split_ledger.read_ledger(ledger) if e["kind"] == "use"]
    assert len(seen) == 2 and [e["use_number"] for e in uses] == [1, 2]
    assert uses[1]["reason"] == "the checkpoint was lost"
    assert ledger.read_text().startswith(before)  # appended, not rewritten
    table = split_ledger.ledger_table(split_ledger.read_ledger(ledger), {"compare.py"}, "steps")
    assert "| compare.py | fashion_mnist | vit_dino | 400 | row: 0 × 2 |" in table
    assert table.endswith("| R1 |\n\n- R1: the checkpoint was lost")  # each reason once


def test_a_validation_run_writes_nothing_to_the_ledger(tmp_path, monkeypatch):
    ledger, seen = tmp_path / "ledger.jsonl", []
    fake_compare(monkeypatch, ledger, seen)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "compare.py",
            "--phase",
            "val",
            "--rows",
            "vit_dino",
            "--seeds",
            "0",
            "--curve_seeds",
            "--skip_linear",
            "--log",
            str(tmp_path / "a.jsonl"),
            "--work_dir",
            str(tmp_path / "w"),
            "--ledger",
            str(ledger),
        ],
    )
    compare.main()
    assert len(seen) == 1 and not ledger.exists()


def test_results_appends_before_the_test_split_is_read_and_refuses_a_second_use(
    tmp_path, monkeypatch
):
    ledger, seen = tmp_path / "ledger.jsonl", []

    def fake_run(name, variant, extra, phase, seed, work_dir, before_test):
        before = [e for e in split_ledger.read_ledger(ledger) if e["kind"] == "use"]
        before_test()           # the trained run is about to read the test split
        seen.append([e for e in split_ledger.read_ledger(ledger) if e["kind"] == "use"])
        assert len(seen[-1]) == len(before) + 1
        return {"run": name, "variant": variant, "phase": phase, "seed": seed, "top1": 61.0}

    monkeypatch.setattr(results, "train_and_evaluate_unstamped", fake_run)

    def main(log, *extra):
        monkeypatch.setattr(
            sys,
            "argv",
            [
                "results.py",
                "--runs",
                "selfpatch_epochs1",
                "--phase",
                "test",
                "--seeds",
                "1",
                "--log",
                str(tmp_path / log),
                "--ledger",
                str(ledger),
                *extra,
            ],
        )
        results.main()

    main("a.jsonl")
    assert [(e["row"], e["seed"], e["budget"]) for e in seen[0]] == [("selfpatch_epochs1", 1, 1)]
    with pytest.raises(SystemExit) as stop:  # a variant at the same budget: another look at test
        main("b.jsonl", "--variant", "tt0.02", "--extra", "--teacher_temp 0.02")
    assert str(stop.value).startswith(
        "error: the test split was evaluated for selfpatch_epochs1 seed 1"
    )
    assert len(seen) == 1
    main("b.jsonl", "--variant", "epochs3", "--extra", "--epochs 3")  # another budget: a first use
    assert [e["budget"] for e in seen[1]] == [1, 3]


def test_quickstart_records_no_use_for_a_run_stopped_in_training(tmp_path, monkeypatch):
    """A run stopped (SIGTERM) while it trains has read no test image: no use is recorded, and
    the same command goes on without --reason; the use is recorded before the first k-NN."""
    ledger, seen = tmp_path / "ledger.jsonl", []

    class Stop(Exception):
        pass

    def stopped_in_training(cmd, log_path):
        raise Stop

    def fake_run(cmd, log_path):
        if "eval_knn.py" not in cmd[1]:
            return ""
        seen.append([e for e in split_ledger.read_ledger(ledger) if e["kind"] == "use"])
        raise Stop

    args = quickstart.get_args_parser().parse_args(
        ["--work_dir", str(tmp_path / "w"), "--ledger", str(ledger)]
    )
    monkeypatch.setattr(provenance, "run", stopped_in_training)
    with pytest.raises(Stop):
        quickstart.run(args)
    assert split_ledger.read_ledger(ledger) == []
    monkeypatch.setattr(provenance, "run", fake_run)
    monkeypatch.setattr(provenance, "check_trained", lambda cmd, out: None)
    with pytest.raises(Stop):
        quickstart.run(args)
    assert [(e["row"], e["data"], e["budget"]) for e in seen[0]] == [
        ("dino trained on fashion_mnist", "fashion_mnist", 400)
    ]
    with pytest.raises(SystemExit):
        quickstart.run(args)
    assert len(seen) == 1
    args.reason = "relogged with a stamp"
    with pytest.raises(Stop):
        quickstart.run(args)
    assert seen[1][-1]["reason"] == "relogged with a stamp"


def test_an_unreadable_ledger_stops_the_driver_before_any_evaluation(tmp_path, monkeypatch):
    ledger, seen = tmp_path / "ledger.jsonl", []
    ledger.write_text('{"kind": "use", "row": "vit_dino"\n')  # a cut line
    fake_compare(monkeypatch, ledger, seen)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "compare.py",
            "--phase",
            "test",
            "--rows",
            "vit_dino",
            "--seeds",
            "0",
            "--log",
            str(tmp_path / "a.jsonl"),
            "--work_dir",
            str(tmp_path / "w"),
            "--ledger",
            str(ledger),
        ],
    )
    with pytest.raises(SystemExit) as stop:
        compare.main()
    assert str(stop.value).startswith("error: --ledger") and not seen


def test_the_documents_count_of_test_uses_is_the_ledgers():
    """Each line of the generated "Test uses" blocks is a (driver, data, row, budget) of the ledger,
    and its uses per seed add up to the ledger's uses of that group: a reader counts them there."""
    entries = split_ledger.read_ledger(LEDGER)
    uses = [e for e in entries if e["kind"] == "use"]
    blocks = [
        compare.generated_blocks(
            provenance.read_log(ROOT / "docs" / "data" / "compare_32px.jsonl")
        )["test_uses"],
        results.generated_blocks(
            provenance.read_log(ROOT / "docs" / "data" / "results_32px.jsonl")
        )["test_uses"],
    ]
    counted = 0
    for text in blocks:
        for line in [line for line in text.splitlines()[2:] if line.startswith("| ")]:
            driver, data, row, budget, per_seed = [c.strip() for c in line.split("|")[1:6]]
            group = [
                e
                for e in uses
                if (e["driver"], e["data"], e["row"], str(e["budget"]))
                == (driver, data, row, budget if budget != "—" else "None")
            ]
            total = sum(int(n) for n in re.findall(r"× (\d+)", per_seed))
            assert group and total == len(group), line
            counted += total
    assert counted == len(uses)  # every use of the ledger is in a document
    for name in ("compare.py", "results.py"):          # the appendix holds both
        assert f"<!-- {name}:test_uses -->" in (ROOT / "docs" / "APPENDIX.md").read_text()


USE = {"driver": "compare.py", "data": "d", "row": "vit_dino", "seed": 0, "budget": 400,
       "evaluation": "row", "command": "python dino.py"}


def test_an_append_starts_on_a_new_line_and_never_goes_through_a_link(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    use_id = split_ledger.record_test_use(ledger, USE)
    ledger.write_text(ledger.read_text().rstrip("\n"))        # its last line without its newline
    split_ledger.record_test_result(ledger, use_id, 61.0)
    assert [e["kind"] for e in split_ledger.read_ledger(ledger)] == ["use", "result"]
    target = tmp_path / "elsewhere.jsonl"
    target.write_text(ledger.read_text())
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(SystemExit, match="symbolic link"):
        split_ledger.record_test_use(link, {**USE, "row": "vit_esvit"})
    with pytest.raises(SystemExit, match="symbolic link"):
        provenance.append_line(link, {"a": 1})
    assert target.read_text() == ledger.read_text()


@pytest.mark.parametrize("line, message", [
    ({"kind": "use", **{k: v for k, v in USE.items() if k != "driver"}, "id": "a",
      "reason": "first use"}, "record 1 (use): driver is missing, not a text"),
    ({"kind": "result", "id": "a"}, "record 1 (result): result is missing"),
    ({"kind": "use", **USE, "seed": [0, 1], "id": "a", "reason": "r"},
     "record 1 (use): seed is [0, 1], not an integer"),
    ({"kind": "usage", "id": "a"}, "record 1: kind \"usage\" is not one of use, result, reason"),
])
def test_every_field_of_a_ledger_line_is_checked_in_one_line(tmp_path, line, message):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps(line) + "\n")
    with pytest.raises(SystemExit) as stop:
        split_ledger.read_ledger(ledger)
    assert message in str(stop.value) and "\n" not in str(stop.value)


def test_a_use_written_with_other_types_still_counts(tmp_path):
    """kind "Use" and seed "0": the same key as kind "use" and seed 0, so a second evaluation is
    refused without a reason."""
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps({"kind": "Use", **USE, "seed": "0", "budget": "400", "id": "a",
                                  "reason": "first use"}) + "\n")
    with pytest.raises(SystemExit, match="evaluated for vit_dino seed 0 at budget 400"):
        split_ledger.record_test_use(ledger, USE)
