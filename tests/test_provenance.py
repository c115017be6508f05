"""What the published numbers rest on: the generators refuse to write from a missing, empty or
unreadable log; every figure of a generated block is a logged value (or computed from logged
values); a gain over random initialisation pairs a row only with its own network."""
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/COMPARISON.md", "docs/RESULTS.md", "docs/APPENDIX.md"]


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


@pytest.mark.parametrize("script", ["extras/experiments/compare.py", "extras/experiments/results.py"])
@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "training log", "text", "folder"])
def test_table_refuses_a_log_it_cannot_read_and_writes_nothing(tmp_path, copy, script, kind):
    before = {path: (copy / path).read_bytes() for path in DOCS}
    r = run(copy, script, "--table", "--log", str(bad_logs(tmp_path)[kind]))
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr[-2000:]
    assert {path: (copy / path).read_bytes() for path in DOCS} == before


@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "training log", "text"])
def test_curves_refuse_a_log_that_is_not_a_comparison_log(tmp_path, copy, kind):
    r = run(copy, "extras/experiments/curves.py", "--log", str(bad_logs(tmp_path)[kind]), "--output",
            str(tmp_path / "curves.png"))
    assert r.returncode != 0 and not (tmp_path / "curves.png").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr[-2000:]


@pytest.mark.parametrize("script,args", [("extras/experiments/compare.py", ["--rows", "vit_dino"]),
                                         ("extras/experiments/results.py", ["--runs", "dino"]), ("extras/experiments/quickstart.py", [])])
@pytest.mark.parametrize("kind", ["missing folder", "folder"])
def test_a_log_that_cannot_be_written_stops_the_run_before_any_training(tmp_path, script, args, kind):
    """Its result is appended at the end: a wrong --log path must not be found after an hour's run."""
    log = {"missing folder": tmp_path / "no_such_folder" / "log.jsonl", "folder": tmp_path}[kind]
    r = subprocess.run([sys.executable, script, *args, "--work_dir", str(tmp_path / "work"), "--log", str(log)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and not (tmp_path / "work").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and "nothing was run" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("script,args,log", [("extras/experiments/compare.py", ["--rows", "vit_dino"], "compare_32px.jsonl"),
                                             ("extras/experiments/results.py", ["--runs", "dino"], "results_32px.jsonl"),
                                             ("extras/experiments/quickstart.py", [], "quickstart.jsonl")])
def test_a_log_with_a_cut_line_stops_the_run_before_any_training(tmp_path, script, args, log):
    """A run killed while it appended leaves half a line: results.py gave json's traceback, and quickstart.py
    trained, then appended its record to that half line (lost to every table)."""
    lines = (ROOT / "docs" / "data" / log).read_text().splitlines()
    cut = tmp_path / "log.jsonl"
    cut.write_text("\n".join(lines[:2]) + "\n" + lines[2][:100])
    r = subprocess.run([sys.executable, script, *args, "--work_dir", str(tmp_path / "work"), "--log", str(cut)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and not (tmp_path / "work").exists()
    assert r.stderr == f"error: --log {cut} line 3 is not a JSON line: nothing is written\n", r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Every figure of a generated block comes from the log; every gain pairs a row with its own network
# ------------------------------------------------------------------------------------------------
sys.path.insert(0, str(ROOT / "extras" / "experiments"))
import compare  # noqa: E402
import compare_tables  # noqa: E402
import provenance  # noqa: E402
import split_ledger  # noqa: E402
import quickstart  # noqa: E402
import results  # noqa: E402


@pytest.fixture(autouse=True)
def ledger_elsewhere(tmp_path, monkeypatch):
    """A driver run by a test appends its test uses to a ledger of its own, never to the committed
    one."""
    monkeypatch.setattr(split_ledger, "LEDGER", tmp_path / "test_ledger.jsonl")


LOGS = {"compare": ROOT / "docs" / "data" / "compare_32px.jsonl", "results": ROOT / "docs" / "data" / "results_32px.jsonl",
        "quickstart": ROOT / "docs" / "data" / "quickstart.jsonl"}
IDENTITY = {"seed", "steps", "step", "epoch", "network", "args"}    # what names a line, or is compared, not published


def scaled(value, key=""):
    """Every logged number not in IDENTITY times a factor of its key: a power of 3.7 (from 3.7 up), so
    that no rounded figure can stay the same, and a ratio of two keys (h / ln K) moves by a power of
    3.7 too (a factor like 5.8 / 5.0 could leave a small figure's rounding unchanged)."""
    if isinstance(value, dict):
        return {k: v if k in IDENTITY else scaled(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [scaled(v, key) for v in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    factor = 3.7 ** (1 + sum(map(ord, key)) % 37)
    return round(value * factor) if isinstance(value, int) else value * factor


def all_blocks(logs):
    records = {name: provenance.read_log(path) for name, path in logs.items()}
    return {**{f"compare.py:{k}": v for k, v in compare.generated_blocks(records["compare"]).items()},
            **{f"results.py:{k}": v for k, v in results.generated_blocks(records["results"]).items()},
            **{f"quickstart.py:{k}": v for k, v in quickstart.generated_blocks(records["quickstart"]).items()}}


def published_figures(text):
    """(line, figure) of every decimal figure of a block: not in code, dates, flags or labels."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    figures = []
    for number, line in enumerate(text.splitlines()):
        if line.startswith("|---") or (line.startswith("| ") and number == 0):
            continue                                                   # a table's header
        line = re.sub(r"`[^`]*`|\d{4}-\d{2}-\d{2}(T[0-9:]+Z)?|--\w+ [-0-9. ]+", "", line)
        figures += [(number, float(m)) for m in re.findall(r"(?<![\w.])[-+]?\d+\.\d+(?![\w.])", line)]
    return figures


def test_every_published_figure_of_the_generated_blocks_comes_from_a_logged_number(tmp_path):
    """Regenerated from a log whose every number is scaled, each decimal figure of every block
    changes (zero aside): none is typed in by hand, and each rests on a logged value."""
    logs = {}
    for name, path in LOGS.items():
        logs[name] = tmp_path / path.name
        logs[name].write_text("".join(json.dumps(scaled(r)) + "\n" for r in provenance.read_log(path)))
    before, after = all_blocks(LOGS), all_blocks(logs)
    for block, text in before.items():
        if block.endswith((":withdrawn", ":test_uses")):     # the ledger's (tests/test_ledger.py)
            continue
        for (line, figure), (_, moved) in zip(published_figures(text), published_figures(after[block])):
            assert figure == 0 or moved != figure, f"{block} line {line}: {figure} does not come from the log"
    documents = "".join((ROOT / p).read_text() for p in DOCS)
    for block in before:                   # every generated block of the documents is one of these
        tag, name = block.split(":")
        assert f"<!-- {block} -->" in documents or name not in ("summary", "added", "result"), block


def test_generated_blocks_of_the_documents_are_the_generators_output_for_the_committed_logs():
    blocks = all_blocks(LOGS)
    for path in DOCS:
        text = (ROOT / path).read_text()
        for tag in ("compare.py", "results.py", "quickstart.py"):
            mine = {k.split(":")[1]: v for k, v in blocks.items() if k.startswith(tag)}
            assert results.refresh(text, mine, tag=tag) == text, f"{path}: stale {tag} block; run python extras/experiments/{tag} --table"


def test_every_line_the_documents_publish_holds_its_time_commit_and_machine():
    """A line written before stamps existed is published only beside its stamped rerun (the `relogged`
    and `Superseded` notes), or, in RESULTS.md, listed by its command alone: no table or figure rests on it."""
    shown = compare_tables.current(provenance.read_log(LOGS["compare"]))
    assert [compare_tables.log_key(r) for r in shown if not (r.get("utc") and r.get("commit") and r.get("machine"))] == []
    shown = quickstart.latest(provenance.read_log(LOGS["quickstart"]))
    assert [quickstart.key(r) for r in shown if not (r.get("utc") and r.get("commit") and r.get("machine"))] == []
    records = provenance.read_log(LOGS["results"])            # RESULTS.md: the same without those lines
    stamped = [r for r in records if r.get("utc") and r.get("commit") and r.get("machine")]
    published = ("test", "val", "drloc_regime", "commands")
    assert [results.generated_blocks(records)[k] for k in published] == \
        [results.generated_blocks(stamped)[k] for k in published]


def test_no_generated_block_holds_a_line_logged_without_its_row():
    """Every row of the comparison's tables is a logged row (no table line without a log line)."""
    records = provenance.read_log(LOGS["compare"])
    logged = {r["row"] for r in records}
    for name, text in compare.generated_blocks(records).items():
        if name in ("test_uses", "withdrawn"):       # the ledger's rows (tests/test_ledger.py)
            continue
        for line in text.splitlines()[2:] if text.startswith("|") else []:
            row = line.split("|")[2 if name == "findings" else 1].strip().strip("`")
            assert row in logged | {"raw pixels", "vit_pico", "swin_pico3"}, (name, row)


def selfpatch_records():
    """vit_selfpatch and the two random-init rows of the ViT, as shown (network records of their own)."""
    records = compare_tables.current(provenance.read_log(LOGS["compare"]))
    chosen = [r for r in records if (r["data"], r["phase"], r["variant"]) == ("fashion_mnist", "test", "recipe")
              and r["row"] in ("vit_selfpatch", "vit_random", "vit_selfpatch_random", "vit_dino")]
    return chosen


def test_every_logged_gain_pairs_a_row_with_its_own_network():
    records = compare_tables.current(provenance.read_log(LOGS["compare"]))
    base = {}
    for r in records:
        if r.get("random_init"):
            base.setdefault((r["data"], r["phase"], r["row"], r["seed"]), r)
    pairs = 0
    for r in records:
        if r["row"] in compare_tables.METHOD_FLAGS:
            b = base.get((r["data"], r["phase"], compare_tables.baseline_row(r["row"]), r["seed"]))
            if b is not None:
                assert r["network"] == b["network"], (r["row"], b["row"])
                pairs += 1
    assert pairs >= 20
    selfpatch = [r for r in records if r["row"] == "vit_selfpatch"][0]
    dino = [r for r in records if r["row"] == "vit_dino"][0]
    assert selfpatch["network"]["image_token"] == "ca_head"
    assert compare_tables.network_of(selfpatch) != compare_tables.network_of(dino)


def test_a_gain_over_another_networks_random_init_is_refused(monkeypatch):
    """SelfPatch paired with DINO's ViT at random init (the CLS-token network) is one line and an exit."""
    records = selfpatch_records()
    monkeypatch.setattr(compare_tables, "RANDOM_ROWS", {"vit_random": "vit_dino", "swin_random": "swin_dino"})
    with pytest.raises(SystemExit, match="vit_selfpatch .* cannot be paired with vit_random: another network"):
        compare_tables.comparison_table(records, "fashion_mnist", "test")


def test_a_row_without_its_own_random_init_shows_no_gain():
    records = [r for r in selfpatch_records() if r["row"] != "vit_selfpatch_random"]
    line = next(l for l in compare_tables.comparison_table(records, "fashion_mnist", "test").splitlines()
                if l.startswith("| vit_selfpatch |"))
    assert line.split("|")[6].strip() == "—" and line.split("|")[8].strip() == "—"


def test_the_random_init_row_evaluates_the_runs_starting_weights(tmp_path, monkeypatch):
    """What eval_knn.py --random_init --seed S rebuilds from a row's checkpoint is the network its
    training command starts from: the method's main() student before its first step (DINO and
    SelfPatch, whose networks differ)."""
    import common
    import eval_knn
    for script, extra in (("dino", []), ("selfpatch", ["--patch_out_dim", "64", "--k_num", "3"])):
        module = __import__(script)
        flags = ["--arch", "vit_pico", "--patch_size", "8", "--dataset", "synthetic", "--synthetic_images", "16",
                 "--synthetic_image_size", "32", "--global_crop_size", "32", "--local_crop_size", "16",
                 "--local_crops_number", "2", "--out_dim", "64", "--batch_size_per_gpu", "8", "--num_workers", "0",
                 "--epochs", "1", "--warmup_epochs", "0", "--device", "cpu", "--precision", "fp32", "--seed", "3", *extra,
                 "--output_dir", str(tmp_path / script)]
        captured = {}

        class Started(Exception):
            pass

        def first_step(student, *args, **kwargs):
            captured.update({k: v.clone() for k, v in common.unwrap(student).state_dict().items()})
            raise Started

        monkeypatch.setattr(module, "train_one_epoch", first_step)
        with pytest.raises(Started):
            module.main(module.get_args_parser().parse_args(flags))
        provenance.starting_checkpoint(" ".join(["python", f"{script}.py", *flags]), tmp_path / f"{script}.pth")
        common.fix_random_seeds(3)
        model, _ = eval_knn.load_backbone(str(tmp_path / f"{script}.pth"), random_init=True)
        state = model.state_dict()
        prefix = "" if isinstance(model, eval_knn.PooledViT) else "backbone."
        assert {prefix + k for k in state} <= set(captured), script
        for k, v in state.items():
            assert torch.equal(v, captured[prefix + k]), (script, k)


def test_a_line_names_the_commit_its_work_started_from(monkeypatch):
    """A commit made while a run trains (a log line, a doc) is not the code that ran: the stamp keeps the start's."""
    sys.path.insert(0, str(ROOT / "extras" / "experiments"))
    import provenance
    head = {"rev-parse": "a" * 40, "status": " M common.py"}
    monkeypatch.setattr(provenance, "git", lambda *args: head[args[0]])
    started = provenance.start()
    head.update({"rev-parse": "b" * 40, "status": ""})                  # committed during the run
    line = provenance.stamp(started)
    assert line["commit"] == "a" * 40 and line["uncommitted"] == ["common.py"]
    assert line["started_utc"] == started["started_utc"] and line["machine"]["load_average_end"]



@pytest.mark.parametrize("name, sent", [("SIGTERM", "os.kill(os.getppid(), signal.SIGTERM)"),    # kill, timeout
                                        ("Ctrl-C", "[os.kill(p, signal.SIGINT) for p in (os.getppid(), os.getpid())]")])
def test_a_signal_to_a_driver_stops_its_command_which_is_not_left_running(tmp_path, name, sent):
    """A SIGTERM to results.py / compare.py alone reaches the training it runs (which then writes its
    checkpoint), and the driver says how to go on: not 'failed', not a traceback, no orphan left running.
    (Ctrl-C in a terminal reaches both processes: the command sends SIGINT to both.)"""
    command = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: (print('checkpoint written', flush=True), sys.exit(0)))\n"
               "signal.signal(signal.SIGINT, lambda *_: (print('interrupted', flush=True), sys.exit(130)))\n"
               f"time.sleep(0.5)\n{sent}\ntime.sleep(60)\n")
    caught = []

    def tests_handler(*_):        # were the driver's handler not in place, this one would see the SIGTERM
        caught.append("SIGTERM")
    previous = signal.signal(signal.SIGTERM, tests_handler)
    try:
        log = tmp_path / "command.txt"
        with pytest.raises(SystemExit, match=re.escape(f"stopped ({name}) during -c; see {log}; run the same command "
                                                       f"again to go on")):
            provenance.run([sys.executable, "-c", command], log)
        assert log.read_text() == {"SIGTERM": "checkpoint written\n", "Ctrl-C": "interrupted\n"}[name]
        assert not caught and signal.getsignal(signal.SIGTERM) is tests_handler          # put back
    finally:
        signal.signal(signal.SIGTERM, previous)


ONLY_KEYS = {"compare": {"data": "fashion_mnist", "row": "vit_dino", "variant": "recipe",
                         "phase": "test", "seed": 0},
             "results": {"run": "dino", "phase": "test", "seed": 0},
             "quickstart": {"data": "fashion_mnist", "phase": "test", "variant": "quickstart",
                            "knn_top1": 60.0, "random_init_knn_top1": 50.0}}


@pytest.mark.parametrize("argv", [["compare.py", "--table"], ["results.py", "--table"],
                                  ["quickstart.py", "--table"], ["curves.py"]])
def test_a_log_line_without_a_field_the_tables_read_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                           argv):
    """A line that holds only the keys a log must have (no figures) was a KeyError deep inside a
    table; each generator names the line and the field, and writes nothing."""
    import curves
    name = {"curves.py": "compare"}.get(argv[0], argv[0][:-3])
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(ONLY_KEYS[name]) + "\n")
    monkeypatch.setattr(provenance.os, "chdir", lambda path: None)
    before = {path: (ROOT / path).read_bytes() for path in DOCS}
    with pytest.raises(SystemExit) as stop:
        if argv[0] == "curves.py":
            curves.main(curves.get_args_parser().parse_args(
                [*argv[1:], "--log", str(log), "--output", str(tmp_path / "c.png")]))
        else:
            monkeypatch.setattr(sys, "argv", [*argv, "--log", str(log)])
            {"compare": compare, "results": results, "quickstart": quickstart}[name].main()
    message = str(stop.value)
    assert message.startswith(f"error: --log {log} record 1: ") and "\n" not in message, message
    assert {path: (ROOT / path).read_bytes() for path in DOCS} == before


def test_a_log_lines_command_is_never_imported(tmp_path, monkeypatch):
    """compare.py builds the network of a logged command (a random-init row's `start_of`, for
    --add_linear) by importing the module it names (`python this.py` printed the Zen of Python):
    only a method file is imported."""
    (tmp_path / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for command in ("python planted.py --arch vit_pico", "python this.py", "rm -rf /", "python"):
        with pytest.raises(SystemExit) as stop:
            provenance.starting_checkpoint(command, tmp_path / "start.pth")
        assert str(stop.value).startswith("error: a logged command"), stop.value
    assert not (tmp_path / "ran").exists() and "this" not in sys.modules
    with pytest.raises(SystemExit) as stop:                 # a method file, with a flag it lacks
        provenance.parse_training_command("python dino.py --no_such_flag 3")
    assert str(stop.value).startswith("error: the logged command")
