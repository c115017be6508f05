"""extras/experiments/results.py (docs/RESULTS.md's Fashion-MNIST tables) and extras/experiments/compare.py (docs/COMPARISON.md's
controlled comparison) are not run by CI: their runs take CPU-hours. Check here that every recipe and
comparison row still parses with its script's own arguments, the tables and the learning-curve picture."""
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extras" / "experiments"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "extras" / "tools"))
import claims  # noqa: E402
import compare  # noqa: E402
import provenance  # noqa: E402
import split_ledger  # noqa: E402
import quickstart  # noqa: E402
import results  # noqa: E402
import curves  # noqa: E402


@pytest.fixture(autouse=True)
def ledger_elsewhere(tmp_path, monkeypatch):
    """A driver run by a test appends its test uses to a ledger of its own, never to the committed
    one."""
    monkeypatch.setattr(split_ledger, "LEDGER", tmp_path / "test_ledger.jsonl")


@pytest.mark.parametrize("name", [n for n, (script, _) in results.RUNS.items() if script])
def test_recipe_parses_with_its_script(name):
    script, flags = results.RUNS[name]
    module = importlib.import_module(script[:-3])
    args = module.get_args_parser().parse_args(flags.split())
    assert args.dataset == "fashion_mnist"
    assert (args.global_crop_size if script != "drloc.py" else args.input_size) in (28, 32)


def test_table_reports_mean_half_range_and_gain_over_random_init_per_phase():
    records = [{"run": "dino", "variant": "recipe", "phase": "test", "seed": 0, "top1": 60.0, "random_init_top1": 50.0,
                "train_seconds": 600, "peak_memory_mb": 900, "utc": "2026-11-27T10:00:00Z"},
               {"run": "dino", "variant": "recipe", "phase": "test", "seed": 1, "top1": 64.0, "random_init_top1": 52.0,
                "train_seconds": 660, "peak_memory_mb": 950, "utc": "2026-11-28T10:00:00Z"},
               {"run": "dino", "variant": "recipe", "phase": "val", "seed": 0, "top1": 1.0, "random_init_top1": 1.0,
                "train_seconds": 60, "peak_memory_mb": 900, "utc": "2026-11-27T09:00:00Z"},
               {"run": "pixels", "variant": "recipe", "phase": "test", "seed": 0, "top1": 84.6, "train_seconds": 0.0,
                "utc": "2026-11-27T11:00:00Z"}]
    lines = results.table(records, "test").splitlines()
    assert lines[2:] == ["| dino | recipe | 2 | 62.0 ± 2.0 | 51.0 ± 1.0 | 11.0 ± 1.0 (+10.0, +12.0): finding | 10.5 | 950 | 2026-11-27 / 2026-11-28 |",
                         "| raw pixels | — | — | 84.6 | — | — | — | — | 2026-11-27 |"]


def test_results_publish_only_stamped_lines():
    """A line without a time, commit and machine (written before stamps existed) is in no table,
    paired comparison or command."""
    def line(run, seed, top1, **more):
        return {"run": run, "variant": "recipe", "phase": "test", "seed": seed, "top1": top1, "peak_memory_mb": 900,
                "train_seconds": 60, "train_command": f"python drloc.py {results.RUNS[run][1]} --seed {seed}", **more}
    stamp = {"utc": "2026-11-27T10:00:00Z"}
    records = [line("drloc", 0, 41.0), line("drloc_base", 0, 40.0), line("drloc", 1, 42.0), line("drloc_base", 1, 40.5),
               line("drloc5k_vit", 0, 59.0, **stamp)]
    blocks = results.generated_blocks(records)
    assert blocks["test"].splitlines()[2:] == ["| drloc5k_vit (supervised top-1, ± std) | recipe (test only) | 1 | 59.0 ± 0.0 | — | — "
                                                "| 1.0 | 900 | 2026-11-27 | 0: no use in the ledger |"]   # no drloc row, no paired line
    assert "41.0" not in "".join(blocks.values()) and "--runs drloc " not in blocks["commands"]


def test_results_a_stamped_line_replaces_the_unstamped_ones_of_its_run():
    old = [{"run": "dino", "variant": "recipe", "phase": "test", "seed": seed, "top1": 60.0 + seed,
            "random_init_top1": 50.0, "train_seconds": 600, "peak_memory_mb": 900,
            "train_command": "python dino.py --seed 0"} for seed in (0, 1)]
    stamped = [{**old[1], "top1": 61.25, "utc": "2026-11-26T10:00:00Z"},
               {**old[0], "top1": 63.5, "random_init_top1": 50.5, "utc": "2026-11-26T11:00:00Z"}]
    blocks = results.generated_blocks([*old, *stamped])
    assert "| dino | recipe (test only) | 2 | 62.4 ± 1.1 | 50.2 ± 0.2 |" in blocks["test"]   # stamped alone


def test_the_drivers_read_a_relative_path_from_where_it_was_typed(tmp_path, monkeypatch):
    """Run from another folder, a relative --log and --work_dir are that folder's (results.py trained in the
    repository root's runs/ but looked for the run in the caller's: an hour's run, then an error), the defaults
    stay in the repository, and the scripts run from its root with the logged commands' relative paths."""
    seen = []
    monkeypatch.setattr(results, "train_and_evaluate", lambda name, variant, extra, phase, seed,
                        work_dir, *ledger:
                        seen.append(work_dir) or {"run": name, "variant": variant, "phase": phase, "seed": seed,
                                                  "top1": 60.0, "train_seconds": 1.0})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["results.py", "--runs", "dino", "--seeds", "0", "--log", "log.jsonl", "--work_dir", "mine"])
    results.main()
    assert seen == [str(tmp_path / "mine")] and json.loads((tmp_path / "log.jsonl").read_text())["top1"] == 60.0
    assert Path.cwd() == provenance.ROOT
    for script, module in (("compare.py", compare), ("quickstart.py", quickstart), ("results.py", results)):
        args = module.get_args_parser().parse_args(["--log", "log.jsonl"])
        monkeypatch.chdir(tmp_path)
        provenance.run_from_root(args, "work_dir", "log")
        assert args.log == str(tmp_path / "log.jsonl") and args.work_dir.startswith("runs/"), script


@pytest.mark.parametrize("extra", ["--holdout 10000", "--epochs 2 --holdout=10000", "--seed 3", "--output_dir x",
                                   "--hold 10000", "--see=3"])          # argparse reads an unambiguous prefix
def test_results_extra_cannot_set_what_the_phase_and_seed_set(tmp_path, monkeypatch, extra):
    """A test line trained with --extra "--holdout ..." would be scored on validation images: refused before any run."""
    monkeypatch.setattr(results, "train_and_evaluate", lambda *a: pytest.fail("nothing may run"))
    monkeypatch.setattr(sys, "argv", ["results.py", "--runs", "dino", "--phase", "test", "--variant", "v",
                                      f"--extra={extra}", "--log", str(tmp_path / "log.jsonl")])
    with pytest.raises(SystemExit, match="--extra cannot set --holdout, --output_dir, --seed: --phase, --seeds"):
        results.main()


@pytest.mark.parametrize("extra", ["--holdout 0", "--hold=0", "--dataset synthetic", "--data_path x", "--epochs 16",
                                   "--max_steps 100", "--saveckp_freq 1", "--seed 3"])
def test_compare_extra_cannot_set_the_data_split_or_budget_its_line_names(tmp_path, monkeypatch, extra):
    """A val line trained with --extra "--holdout 0" would be scored on its own training images, one with
    "--epochs 16" would name 400 steps: refused before any run."""
    monkeypatch.setattr(compare, "run_row", lambda *a: pytest.fail("nothing may run"))
    monkeypatch.setattr(sys, "argv", ["compare.py", "--rows", "vit_dino", "--phase", "val", "--variant", "v",
                                      f"--extra={extra}", "--log", str(tmp_path / "log.jsonl")])
    with pytest.raises(SystemExit, match="--extra cannot set --data_path, --dataset, --epochs, --holdout, "
                                         "--max_steps_per_epoch, --output_dir, --saveckp_freq, --seed: --data, --phase"):
        compare.main()
    assert results.flags_set_by("--lr 0.001 --warmup_epochs 2 --epoch", compare.DRIVER_FLAGS) == ["--epochs"]
    monkeypatch.setattr(quickstart, "run", lambda *a: pytest.fail("nothing may run"))
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--phase", "val", "--variant", "v", f"--extra={extra}",
                                      "--log", str(tmp_path / "log.jsonl")])
    with pytest.raises(SystemExit, match="--extra cannot set --[a-z_]+: its line would name another split"):
        quickstart.main()


@pytest.mark.parametrize("argv", [["results.py", "--runs", "dino", "--seeds", "0", "-1"],
                                  ["compare.py", "--rows", "vit_dino", "--seeds", "-1"],
                                  ["compare.py", "--rows", "vit_dino", "--curve_seeds", "-2"]])
def test_a_negative_seed_is_refused_before_any_run(argv, capsys):
    """Training refuses --seed -1 only after the driver has made the run's folder: the drivers refuse it first."""
    parser = (results if argv[0] == "results.py" else compare).get_args_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(argv[1:])
    assert "is out of range: expected a value in [0, inf)" in capsys.readouterr().err


def test_quickstart_a_stamped_line_replaces_the_unstamped_ones_of_its_key():
    line = {"data": "fashion_mnist", "trained_on": "fashion_mnist", "phase": "val", "steps": 250,
            "knn_top1": 56.0, "random_init_knn_top1": 52.0}
    old = [{**line, "variant": "base", "extra": "--precision bf16"}, {**line, "variant": "s400", "steps": 400,
                                                                       "knn_top1": 59.0}]
    stamped = [{**r, "knn_top1": 57.25, "utc": "2026-11-26T11:00:00Z"} for r in old]
    table = quickstart.variants_table([*old, *stamped])
    assert "| base | 250 | `--precision bf16` | 57.25 | 52.00 | +5.25 |" in table       # the stamped line shown
    assert ("Superseded: variant s400, 59.00 against 52.00 (no timestamp): a later line has the same key; the line "
            "shown: 57.25 against 52.00, gain now minus then -1.75") in table


def test_drloc_comparison_is_paired_by_seed():
    records = [{"run": run, "variant": "recipe", "phase": "test", "seed": seed, "top1": top1}
               for run, seed, top1 in [("drloc", 0, 50.0), ("drloc", 1, 54.0), ("drloc", 2, 52.0), ("drloc", 3, 99.0),
                                       ("drloc_base", 0, 49.0), ("drloc_base", 1, 51.0), ("drloc_base", 2, 52.0)]]
    line = results.paired_difference(records, "test")
    # seed 3 has no baseline: differences +1, +3, 0 -> mean 1.33, half-range 1.5: within the spread
    assert line == "drloc - drloc_base, paired by seed: +1.33 (+1.00, +3.00, +0.00; SE 0.50): undecided"
    moved = results.paired_difference([{**r, "top1": r["top1"] + 5 * (r["run"] == "drloc")} for r in records], "test")
    assert moved.endswith(": finding")
    assert results.paired_difference(records[:1] + records[4:5], "test") is None


def test_results_md_is_what_table_generates_from_the_log():
    """docs/RESULTS.md's tables and commands are `results.py --table`'s output for the committed log."""
    records = provenance.read_log(results.ROOT / "docs" / "data" / "results_32px.jsonl")
    assert "<!-- results.py:test -->" in results.RESULTS_MD.read_text()
    assert "<!-- results.py:commands -->" in results.APPENDIX_MD.read_text()
    for path in (results.RESULTS_MD, results.APPENDIX_MD):
        committed = path.read_text()
        assert results.refresh(committed, results.generated_blocks(records)) == committed, \
            f"{path.name} is stale: run python extras/experiments/results.py --table"


def test_each_listed_command_trains_what_its_logged_runs_trained():
    """The recipe as it stands plus the command's --extra parses to the logged run's arguments."""
    for record in provenance.read_log(results.ROOT / "docs" / "data" / "results_32px.jsonl"):
        if record["run"] == "pixels":
            continue
        script, flags = results.RUNS[record["run"]]
        parser = importlib.import_module(script[:-3]).get_args_parser()
        rebuilt = parser.parse_args(flags.split() + results.extra_flags(record).split())
        assert rebuilt == parser.parse_args(results.logged_flags(record)), (record["run"], record["variant"])


def test_refresh_replaces_only_the_generated_blocks():
    text = "intro\n<!-- results.py:val -->\nold\n<!-- /results.py -->\nmiddle\n<!-- results.py:test -->\n<!-- /results.py -->\n"
    assert results.refresh(text, {"val": "V", "test": "T"}) == \
        "intro\n<!-- results.py:val -->\nV\n<!-- /results.py -->\nmiddle\n<!-- results.py:test -->\nT\n<!-- /results.py -->\n"
    with pytest.raises(SystemExit, match="block 'other'"):
        results.refresh("<!-- results.py:other -->\n<!-- /results.py -->", {})


# ------------------------------------------------------------------------------------------------
# extras/experiments/compare.py: the controlled comparison
# ------------------------------------------------------------------------------------------------
def parse_row(row, data="fashion_mnist", phase="test", steps=400, curve_every=100):
    _, script, _ = compare.METHOD_FLAGS[row]
    parser = importlib.import_module(script[:-3]).get_args_parser()
    flags = compare.training_flags(row, steps, curve_every) + compare.data_flags(data, phase, "runs/data")
    return parser, parser.parse_args(flags)


@pytest.mark.parametrize("data", list(compare.DATA))
@pytest.mark.parametrize("row", list(compare.METHOD_FLAGS))
def test_comparison_rows_parse_with_their_scripts(row, data):
    _, args = parse_row(row, data)
    assert (args.epochs * args.max_steps_per_epoch, args.saveckp_freq * compare.STEPS_PER_EPOCH) == (400, 100)
    assert args.arch == {"vit": "vit_pico", "swin": "swin_pico3"}[compare.METHOD_FLAGS[row][0]]
    assert args.dataset == {"fashion_mnist": "fashion_mnist", "shapes": "synthetic", "fashion_mnist_8k": "folder"}[data]


# the arguments that belong to a method (allowed to differ from its backbone's DINO row)
OWN_ARGS = {"selfpatch.py": {"patch_out_dim", "k_num", "neighbors_wrap", "center_crops",
                             "patch_loss_weight", "patch_teacher_temp"},
            "esvit.py": {"use_region_loss", "init_from"},
            "glsd.py": {"local_matching", "match_threshold"}}


@pytest.mark.parametrize("row", [r for r in compare.METHOD_FLAGS if not r.endswith("_dino")])
def test_within_a_backbone_only_the_methods_own_arguments_differ_from_dino(row):
    """Every argument that the row's script shares with dino.py parses to the DINO row's value."""
    backbone, script, own = compare.METHOD_FLAGS[row]
    _, args = parse_row(row, phase="val")
    _, dino = parse_row(f"{backbone}_dino", phase="val")
    shared = (set(vars(args)) & set(vars(dino))) - OWN_ARGS[script] - {"output_dir"}
    assert shared >= {"lr", "out_dim", "teacher_temp", "global_crops_scale", "norm_last_layer", "holdout", "epochs"}
    assert {k: vars(args)[k] for k in shared} == {k: vars(dino)[k] for k in shared}
    assert set(vars(args)) - set(vars(dino)) <= OWN_ARGS[script]
    assert {flag[2:] for flag in own.split()[::2]} <= OWN_ARGS[script]


def test_comparison_evaluation_flags_parse_with_their_scripts():
    import eval_knn
    import eval_linear
    import eval_correspondence
    import teacher_outputs
    for data in compare.DATA:
        flags = compare.data_flags(data, "test", "runs/data") + provenance.EVAL.split()
        assert eval_knn.get_args_parser().parse_args(flags + ["--nb_knn", "20"]).crop == 32
        linear = eval_linear.get_args_parser().parse_args(flags + provenance.LINEAR.split())
        assert linear.val_freq == linear.epochs    # validated once, after the last epoch: no choice on the test split
        assert teacher_outputs.get_args_parser().parse_args(flags + ["--pretrained_weights", "x"]).resize == 32
        eval_correspondence.get_args_parser().parse_args(compare.data_flags(data, "test", "runs/data") + ["--crop_size", "32"])


def test_comparison_budget_and_phase_errors():
    compare.check_budget(400, 100)
    for steps, every in ((410, 100), (400, 75), (400, 300), (0, 50)):
        with pytest.raises(SystemExit, match="multiples of 50"):
            compare.check_budget(steps, every)
    assert compare.data_flags("fashion_mnist", "val", "d")[-2:] == ["--holdout", "10000"]
    with pytest.raises(SystemExit, match="test phase only"):
        compare.data_flags("shapes", "val", "d")


def test_comparison_parses_the_evaluation_scripts_output():
    import eval_correspondence
    metrics = {"top10_accuracy": 12.5, "top10_distance": 1.25, "accuracy": 33.75, "chance_accuracy": 1.56,
               "distance": 2.5, "pairs": 500}
    text = "\n".join("[12:00:00] " + eval_correspondence.format_metrics(p, metrics) for p in ("esvit", "overlap"))
    parsed = provenance.parse_correspondence(text)
    assert parsed["overlap"] == {k: v for k, v in metrics.items() if k != "pairs"} and set(parsed) == {"esvit", "overlap"}
    collapse = provenance.parse_collapse("dino teacher at temperature 0.04, 2000 images, K = 1024 (ln K = 6.93):\n"
                                      "per-image entropy 6.10 | entropy of the mean target 6.80 | arg-max outputs 9 of 1024")
    assert collapse == pytest.approx({"teacher_entropy": 6.10, "mean_target_entropy": 6.80, "ln_k": 6.931471805599453})


NETWORK = {"arch": "vit_pico", "image_token": "backbone", "keys_sha256": "0123456789abcdef", "tensors": 54,
           "parameters": 207424}


def fake_comparison_records():
    def corr(flip, overlap):
        return {"esvit": {"top10_accuracy": flip, "accuracy": flip / 2}, "overlap": {"accuracy": overlap}}
    records = []
    for seed, shift in ((0, 0.0), (1, 2.0)):
        base = {"data": "fashion_mnist", "phase": "test", "variant": "recipe", "seed": seed, "steps": 400}
        records.append({**base, "row": "vit_dino", "backbone": "vit", "knn_top1": 60.0 + shift, "linear_top1": 70.0,
                        "correspondence": corr(10.0 + shift, 20.0), "teacher_entropy": 3.0 + shift, "ln_k": 6.0,
                        "mean_target_entropy": 6.0, "train_seconds": 600.0 + 60 * shift, "peak_memory_mb": 900 + seed,
                        "network": NETWORK,
                        "curve": [{"step": 200, "knn_top1": 55.0 + shift, "overlap_accuracy": 15.0}]})
        records.append({**base, "row": "vit_random", "backbone": "vit", "random_init": True, "knn_top1": 50.0,
                        "linear_top1": 40.0 + shift, "correspondence": corr(2.0, 10.0), "network": NETWORK})
    records.append({"data": "fashion_mnist", "phase": "test", "variant": "recipe", "seed": 0, "steps": 400,
                    "row": "pixels", "knn_top1": 84.59})
    records.append({k: v for k, v in records[0].items() if k != "linear_top1"} | {"phase": "val", "knn_top1": 1.0})
    return records


def test_comparison_table_is_generated_from_the_log():
    records = fake_comparison_records()
    lines = compare.comparison_table(records, "fashion_mnist", "test").splitlines()
    assert lines[2:] == [
        "| vit_dino | recipe | 400 | 2 | 61.0 ± 1.0 | +11.0 ± 1.0 | 70.0 ± 0.0 | +29.0 ± 1.0 | 11.0 ± 1.0 / 5.5 ± 0.5 "
        "| 20.0 ± 0.0 | 0.67 ± 0.17 | 1.00 ± 0.00 | 11.0 ± 1.0 | 901 | no timestamp |",
        "| vit_random | recipe | — | 2 | 50.0 ± 0.0 | — | 41.0 ± 1.0 | — | 2.0 ± 0.0 / 1.0 ± 0.0 | 10.0 ± 0.0 | — | — "
        "| — | — | no timestamp |",
        "| raw pixels | — | — | — | 84.6 | — | — | — | — | — | — | — | — | — | no timestamp |"]
    assert compare.comparison_table(records, "fashion_mnist", "val").splitlines()[2].startswith(
        "| vit_dino | recipe | 400 | 1 | 1.0 | — | — |")   # no random-init row here, no linear probe; one seed: no ±
    assert compare.comparison_table(records, "shapes", "test") == "No test-phase run of the comparison on shapes is logged yet."
    blocks = compare.generated_blocks(records)
    assert blocks["commands"].splitlines()[1:3] == [
        "python extras/experiments/compare.py --data fashion_mnist --phase test --steps 400 --seeds 0 1 --rows vit_dino vit_random pixels "
        "--curve_every 200 --curve_seeds 0 1",       # curves every 200 steps, for both seeds: not the defaults
        "python extras/experiments/compare.py --data fashion_mnist --phase val --steps 400 --seeds 0 --rows vit_dino --curve_every 200 "
        "--skip_linear"]
    without_curves = [{k: v for k, v in r.items() if k != "curve"} for r in records]
    assert compare.generated_blocks(without_curves)["commands"].splitlines()[1].endswith(
        "--rows vit_dino vit_random pixels --curve_seeds")    # seed 0 trained without its default curve
    text = "a\n<!-- compare.py:fashion_mnist_test -->\nold\n<!-- /compare.py -->\n<!-- results.py:test -->\nkept\n<!-- /results.py -->\n"
    refreshed = results.refresh(text, blocks, tag="compare.py")
    assert refreshed == text.replace("old", blocks["fashion_mnist_test"])
    assert results.refresh(refreshed, compare.generated_blocks(records), tag="compare.py") == refreshed


def test_add_linear_writes_the_probe_into_the_logged_line(tmp_path, monkeypatch):
    """--add_linear probes a logged row's kept checkpoint (a random-init row: its source row's network
    at the first step, written to its own folder) and rewrites that line only; a row already probed,
    or not logged, is left alone."""
    log, work = tmp_path / "log.jsonl", tmp_path / "work"
    records = [r for r in fake_comparison_records() if r["phase"] == "test"]
    for r in records:
        r.pop("linear_top1", None)
        r.update(commands=["python train"], wall_seconds={"train": 1.0}, cpu_seconds={"train": 2.0})
    records[0]["linear_top1"] = 70.0                               # vit_dino seed 0: already probed
    relogged = {**records[3], "utc": "2026-11-26T10:00:00Z"}       # vit_random seed 1, logged again (--relog)
    log.write_text("".join(json.dumps(r) + "\n" for r in [*records, relogged]))
    for seed in (0, 1):
        folder = work / "fashion_mnist" / f"vit_dino_recipe_test_seed{seed}"
        folder.mkdir(parents=True)
        (folder / "checkpoint.pth").write_bytes(b"")
    probed = []

    def fake_linear(self, weights, random_init=False):
        probed.append((weights.parent.name, self.out.name, random_init))
        self.commands.append("python eval_linear.py")
        self.wall_seconds["linear"] = self.cpu_seconds["linear"] = 3.0
        return 33.0 + len(probed)
    monkeypatch.setattr(compare.Evaluator, "linear", fake_linear)
    args = compare.get_args_parser().parse_args(["--phase", "test", "--log", str(log), "--work_dir", str(work)])
    assert [compare.add_evaluation(row, args, seed, "linear_top1") for row in ("vit_dino", "vit_random", "swin_dino")
            for seed in (0, 1)] \
        == [None, 34.0, 35.0, 36.0, None, None]
    assert probed == [("vit_dino_recipe_test_seed1", "vit_dino_recipe_test_seed1", False),
                      ("vit_random_recipe_test_seed0", "vit_random_recipe_test_seed0", True),
                      ("vit_random_recipe_test_seed1", "vit_random_recipe_test_seed1", True)]
    assert (work / "fashion_mnist" / "vit_random_recipe_test_seed0" / "start.pth").is_file()
    after = provenance.read_log(log)
    assert [r.get("linear_top1") for r in after] == [70.0, 35.0, 34.0, None, None, 36.0]
    assert after[1]["commands"] == ["python train", "python eval_linear.py"]
    assert after[1]["cpu_seconds"] == {"train": 2.0, "linear": 3.0}
    assert set(after[1]["linear_provenance"]) >= {"utc", "commit", "machine"}
    assert after[3:5] == records[3:5]        # the pixel row, and the line that a stamped one superseded, untouched


def test_add_curve_evaluates_the_kept_checkpoints_of_the_logged_run_only(tmp_path, monkeypatch):
    """--add_curve writes a learning curve into a logged line that has none, from the checkpoints its
    training kept; one missing, or written outside that training's time, is refused in one line."""
    log, work = tmp_path / "log.jsonl", tmp_path / "work"
    records = [{**r, "started_utc": "2026-11-27T10:00:00Z", "utc": "2026-11-27T11:00:00Z", "commands": [],
                "wall_seconds": {}, "cpu_seconds": {}} for r in fake_comparison_records() if r["phase"] == "test"]
    records[2].pop("curve")                                          # vit_dino seed 1: no curve
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    folder = work / "fashion_mnist" / "vit_dino_recipe_test_seed1"
    folder.mkdir(parents=True)
    for name in ("checkpoint.pth", "checkpoint0004.pth"):
        (folder / name).write_bytes(b"")
    inside = provenance.utc_seconds("2026-11-27T10:30:00Z")
    os.utime(folder / "checkpoint0004.pth", (inside, inside))

    def fake_knn(self, weights, random_init=False, name="knn"):
        self.commands.append(f"python eval_knn.py {weights.name}")
        self.cpu_seconds["curve"] = 5.0
        return {"10": 58.0, "20": 57.5, "100": 55.0, "200": 54.0}
    monkeypatch.setattr(compare.Evaluator, "knn", fake_knn)
    monkeypatch.setattr(compare.Evaluator, "correspondence", lambda self, w, protocols=(), name="": {"overlap": {"accuracy": 16.0}})
    argv = ["--phase", "test", "--log", str(log), "--work_dir", str(work), "--curve_every", "200"]
    args = compare.get_args_parser().parse_args(argv)
    assert [compare.add_evaluation(row, args, seed, "curve") for row, seed in
            (("vit_dino", 0), ("vit_random", 1), ("vit_dino", 1))] == [None, None, [{"step": 200, "knn_top1": 57.5,
                                                                                  "knn_top1_by_k": {"10": 58.0, "20": 57.5, "100": 55.0, "200": 54.0},
                                                                                  "overlap_accuracy": 16.0}]]
    after = provenance.read_log(log)
    assert after[2]["curve"] == [{"step": 200, "knn_top1": 57.5, "overlap_accuracy": 16.0,
                                  "knn_top1_by_k": {"10": 58.0, "20": 57.5, "100": 55.0, "200": 54.0}}]
    assert after[2]["commands"] == ["python eval_knn.py checkpoint0004.pth"] and "curve_provenance" in after[2]
    assert [r for i, r in enumerate(after) if i != 2] == [r for i, r in enumerate(records) if i != 2]
    after[2].pop("curve")
    log.write_text("".join(json.dumps(r) + "\n" for r in after))
    late = provenance.utc_seconds("2026-11-27T12:00:00Z")                # a later run's checkpoint
    os.utime(folder / "checkpoint0004.pth", (late, late))
    with pytest.raises(SystemExit, match="checkpoint0004.pth is not from the logged run"):
        compare.add_evaluation("vit_dino", args, 1, "curve")
    (folder / "checkpoint0004.pth").unlink()
    with pytest.raises(SystemExit, match="checkpoint0004.pth is missing"):
        compare.add_evaluation("vit_dino", args, 1, "curve")
    log.write_text("".join(json.dumps({k: v for k, v in r.items() if "utc" not in k}) + "\n" for r in after))
    with pytest.raises(SystemExit, match="has no times"):                 # a line written before stamps
        compare.add_evaluation("vit_dino", args, 1, "curve")


def test_compare_rewrites_its_log_whole_and_its_lock_still_excludes_after_a_rewrite(tmp_path, monkeypatch):
    """add_evaluation rewrites the log under the lock that other seeds' processes append under: a kill mid-write
    must leave the old log or the new, and a process that waited on the replaced file must not hold the lock
    beside one that locks the new file (the later one's lines would be lost by the first one's rewrite)."""
    log = tmp_path / "compare.jsonl"
    log.write_text('{"a": 1}\n')
    events = []

    def hold(name, seconds):
        with provenance.locked(log):
            events.append(f"{name} in")
            time.sleep(seconds)
            events.append(f"{name} out")

    waiter = threading.Thread(target=hold, args=("waiter", 1.0))
    with provenance.locked(log):
        waiter.start()
        time.sleep(0.5)                                   # it waits on the lock of the file about to be replaced
        provenance.rewrite_log(log, ['{"a": 3}'])
    for _ in range(300):
        if events:
            break
        time.sleep(0.01)
    late = threading.Thread(target=hold, args=("late", 0))
    late.start()
    waiter.join(30)
    late.join(30)
    assert events == ["waiter in", "waiter out", "late in", "late out"]
    assert log.read_text() == '{"a": 3}\n' and [p.name for p in tmp_path.iterdir()] == [log.name]

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(provenance.os, "fsync", full_disk)
    with provenance.locked(log), pytest.raises(OSError):
        provenance.rewrite_log(log, ['{"c": 4}'])
    assert log.read_text() == '{"a": 3}\n' and [p.name for p in tmp_path.iterdir()] == [log.name]


def test_a_test_row_that_never_ran_on_validation_says_so():
    records = fake_comparison_records()
    only_test = [{**r, "row": "vit_esvit"} for r in records if r["row"] == "vit_dino" and r["phase"] == "test"]
    table = compare.comparison_table(records + only_test, "fashion_mnist", "test").splitlines()
    assert [line.split(" | ")[:2] for line in table[2:4]] == [["| vit_dino", "recipe"], ["| vit_esvit", "recipe (test only)"]]
    summary = compare.summary_table(records + only_test).splitlines()
    assert "| `vit_pico` | DINO | 61.0 ± 1.0 | +11.0 ± 1.0 | — |" in summary[3]
    assert "| `vit_pico` | EsViT (not run on validation) | 61.0 ± 1.0 | +11.0 ± 1.0 |" in summary[4]


def test_long_budget_table_sets_each_row_against_the_raw_pixels_of_its_split():
    records = fake_comparison_records()               # vit_dino 60 and 62 (test), 1.0 (val); pixels 84.59 (test)
    assert compare.compare_tables.long_budget_table(records).startswith("No row longer than 400 steps")
    long = [{**r, "steps": 1600, "variant": "steps1600"} for r in records if r["row"] == "vit_dino"]
    lines = compare.compare_tables.long_budget_table(records + long).splitlines()[2:]
    assert [line.split(" | ")[:8] for line in lines] == [
        ["| vit_dino", "val", "steps1600", "1600", "1", "1.0", "—", "—"],              # no val pixel row
        ["| vit_dino", "test", "steps1600", "1600", "2", "61.0 ± 1.0", "+11.0 ± 1.0", "-23.6 ± 1.0 (-24.59, -22.59)"]]
    untried = compare.compare_tables.long_budget_table(records + [r for r in long if r["phase"] == "test"]).splitlines()[2]
    assert untried.split(" | ")[2] == "steps1600 (test only)"


def test_findings_pair_each_seed_with_dino_at_the_same_budget_and_judge_by_the_rule():
    records = fake_comparison_records()                # vit_dino 60 and 62 over random inits of 50 (test)
    long = [{**r, "steps": 1600, "variant": "steps1600"} for r in records if r["row"] == "vit_dino"]
    esvit = [{**r, "row": "vit_esvit", "knn_top1": r["knn_top1"] + 3.0 - r["seed"], "linear_top1": None}
             for r in long if r["phase"] == "test"]
    said = compare.compare_tables.findings(records + long + esvit, "fashion_mnist", "test", "steps1600")
    over_dino = [told for row, other, told in said if row == "vit_esvit" and other.startswith("vit_dino")]
    assert over_dino[0]["knn_top1"] == "+2.50 (+3.00, +2.00; SE 0.49): finding"     # beyond 0.5 and 0.49
    assert over_dino[0]["linear_top1"] is None
    pixels = [told for row, other, told in said if row == "vit_dino" and other.startswith("the raw")]
    assert pixels[0]["knn_top1"].startswith("-23.59 (-24.59, -22.59; SE ")
    table = compare.compare_tables.findings_table(records + long + esvit,
                                                  [("fashion_mnist", "test", "steps1600")])
    assert "| fashion_mnist, test, steps1600 (1600 steps) (test only) | vit_esvit | vit_dino" in table


def test_the_rule_says_finding_no_finding_or_undecided():
    assert claims.finding([1.0, 1.2], 0.5) == "finding"          # beyond spread and error
    assert claims.finding([0.1, -0.1], 0.5) == "no finding"      # beyond neither
    assert claims.finding([1.2, 0.0], 0.5) == "undecided"        # beyond the error only
    assert claims.finding([0.3, 0.3], 0.5) == "undecided"        # beyond the spread only
    assert claims.finding([2.0], 0.5) == "undecided"             # one seed


def test_a_variant_that_trains_a_validated_setting_again_is_not_test_only():
    records = fake_comparison_records()                  # vit_dino: recipe on val and test, 400 steps
    rerun = [{**r, "variant": "fourk"} for r in records if r["row"] == "vit_dino" and r["phase"] == "test"]
    other = [{**r, "variant": "wide", "extra": "--out_dim 4096"} for r in rerun]
    longer = [{**r, "variant": "steps1600_fourk", "steps": 1600} for r in rerun]
    table = compare.comparison_table(records + rerun + other + longer, "fashion_mnist", "test")
    shown = [line.split(" | ")[1] for line in table.splitlines()[2:] if line.startswith("| vit_dino")]
    assert shown == ["recipe", "fourk", "wide (test only)", "steps1600_fourk (test only)"]


def test_a_command_without_a_curve_keeps_the_checkpoint_spacing_its_training_ran_with():
    records = [{k: v for k, v in r.items() if k != "curve"} | {"variant": "steps1600_fourk", "steps": 1600,
               "commands": ["python dino.py --epochs 32 --max_steps_per_epoch 50 --saveckp_freq 8 --seed 0"]}
               for r in fake_comparison_records() if r["row"] == "vit_dino" and r["phase"] == "test"]
    assert compare.reproducing_commands(records) == [
        "python extras/experiments/compare.py --data fashion_mnist --phase test --steps 1600 --seeds 0 1 "
        "--rows vit_dino --curve_every 400 --curve_seeds --variant steps1600_fourk"]


def test_knn_at_four_k_is_set_against_the_pixels_at_the_same_k_seed_by_seed():
    records = fake_comparison_records()
    assert "No trained row" in compare.appendix.knn_k_pixels_table(records)
    pixels = {"10": 85.76, "20": 85.27, "100": 82.95, "200": 81.74}
    network = {0: {"10": 85.0, "20": 86.0, "100": 84.0, "200": 82.0},
               1: {"10": 86.5, "20": 85.5, "100": 84.5, "200": 81.5}}
    by_k = [{**r, "knn_top1_by_k": pixels} if r["row"] == "pixels" and r["phase"] == "test" else
            {**r, "knn_top1_by_k": network[r["seed"]]} if r["row"] == "vit_dino" and r["phase"] == "test" else r
            for r in records]
    partial = {**by_k[-1], "row": "vit_esvit", "phase": "test", "knn_top1_by_k": {"20": 70.0}}
    table = compare.appendix.knn_k_pixels_table(by_k + [partial]).splitlines()
    assert len(table) == 3 and table[2].startswith("| vit_dino | recipe | 400 | 2 | ")
    cells = table[2].split(" | ")[4:]
    for k, text in zip(("10", "20", "100", "200"), cells):
        diffs = [network[seed][k] - pixels[k] for seed in (0, 1)]
        mean, spread = sum(diffs) / 2, abs(diffs[0] - diffs[1]) / 2
        worst = min(network[0][k], network[1][k], pixels[k], key=lambda t: abs(t - 50)) / 100
        error = 100 * (worst * (1 - worst) / 10000) ** 0.5
        beyond = (abs(mean) > spread) + (abs(mean) > error)
        verdict = ["no finding", "undecided", "finding"][beyond]
        assert text.rstrip(" |") == (f"{mean:+.1f} ± {spread:.1f} ({diffs[0]:+.2f}, {diffs[1]:+.2f}): {verdict}")
    assert [c.rsplit(": ", 1)[1].rstrip(" |") for c in cells] == ["no finding", "finding", "finding", "no finding"]
    knn = compare.appendix.knn_k_table(by_k).splitlines()
    assert knn[2].startswith("| vit_dino | fashion_mnist | test | 400 | 0 | 85.00 | 86.00 | 84.00 | 82.00 |")
    assert knn[4].startswith("| pixels | fashion_mnist | test | — | 0 | 85.76 |")


def test_a_stopped_row_resumes_and_a_logged_row_is_skipped(tmp_path, monkeypatch, capsys):
    """A row that left a checkpoint but no log line is trained again by the same command (the method
    script resumes it) and logged without a training time (only the last process's would be known);
    a row already logged is not run again."""
    log, work = tmp_path / "log.jsonl", tmp_path / "work"
    stopped = work / "fashion_mnist" / "vit_dino_recipe_test_seed0"
    stopped.mkdir(parents=True)
    (stopped / "checkpoint.pth").write_bytes(b"")
    calls = []

    def fake_call(self, args, log_name):
        calls.append((self.out.name, log_name))
        self.wall_seconds["train"] = self.cpu_seconds["train"] = 5.0
        (self.out / "args.json").write_text(json.dumps({"precision": "bf16", "epochs": 1}))
        (self.out / "log.txt").write_text(json.dumps({"epoch": 0, "loss": 1.0, "peak_memory_mb": 10}) + "\n")
    monkeypatch.setattr(compare.Evaluator, "call", fake_call)
    by_k = {"10": 61.0, "20": 60.0, "100": 58.0, "200": 57.0}
    for name, value in (("knn", by_k), ("correspondence", {}), ("collapse", {})):
        monkeypatch.setattr(compare.Evaluator, name, lambda self, *a, value=value, **k: value)
    monkeypatch.setattr(compare.provenance, "checkpoint_signature", lambda weights: {"arch": "vit_pico"})
    monkeypatch.setattr(provenance.os, "chdir", lambda path: None)
    argv = ["compare.py", "--phase", "test", "--rows", "vit_dino", "--seeds", "0", "1", "--curve_seeds",
            "--skip_linear", "--log", str(log), "--work_dir", str(work)]
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    assert calls == [("vit_dino_recipe_test_seed0", "train_resumed.txt"), ("vit_dino_recipe_test_seed1", "train.txt")]
    first, second = provenance.read_log(log)
    assert first["resumed"] and "train_seconds" not in first and first["cpu_seconds"] == {"train_resumed": 5.0}
    assert "resumed" not in second and second["train_seconds"] == 5.0
    compare.main()                                   # both logged: nothing runs again
    assert len(calls) == 2 and len(provenance.read_log(log)) == 2
    assert capsys.readouterr().out.count("logged already") == 2


def test_a_row_logged_again_with_a_stamp_replaces_its_unstamped_line():
    """The tables, the pictures' reader and the commands see the stamped line alone."""
    unstamped = [r for r in fake_comparison_records() if r["phase"] == "test" and r["row"] in ("vit_dino", "vit_random")]
    again = [{**{k: v for k, v in unstamped[2].items() if k != "linear_top1"}, "knn_top1": 61.5,
              "utc": "2026-11-26T10:00:00Z", "precision": "bf16"},
             {**unstamped[0], "row": "vit_dino", "knn_top1": 64.25, "linear_top1": 69.0, "utc": "2026-11-26T11:00:00Z",
              "precision": "bf16", "network": NETWORK, "backbone": "vit"}]
    again[1] = {**next(r for r in unstamped if r["row"] == "vit_dino" and r["seed"] == 0), **again[1]}
    records = unstamped + again
    shown = compare.compare_tables.current(records)
    assert [(r["row"], r["seed"], r["knn_top1"]) for r in shown] == [
        ("vit_random", 0, 50.0), ("vit_random", 1, 50.0), ("vit_dino", 1, 61.5), ("vit_dino", 0, 64.25)]
    blocks = compare.generated_blocks(records)
    assert "| vit_dino | recipe (test only) | 400 | 2 | 62.9 ± 1.4 |" in blocks["fashion_mnist_test"]   # (61.5 + 64.25) / 2


def test_comparison_md_is_what_table_generates_from_the_log():
    log = results.ROOT / "docs" / "data" / "compare_32px.jsonl"
    records = provenance.read_log(log) if log.exists() else []
    assert "<!-- compare.py:fashion_mnist_test -->" in compare.COMPARISON_MD.read_text()
    assert "<!-- compare.py:commands -->" in compare.APPENDIX_MD.read_text()
    for path in (compare.COMPARISON_MD, compare.APPENDIX_MD):
        committed = path.read_text()
        assert results.refresh(committed, compare.generated_blocks(records), tag="compare.py") == committed, \
            f"{path.name} is stale: run python extras/experiments/compare.py --table"


@pytest.mark.parametrize("path", compare.SUMMARY_FILES, ids=lambda p: p.name)
def test_summaries_are_what_table_generates_from_the_log(path):
    """README's "Results at a glance" and docs/RESULTS.md hold the comparison's summary block."""
    log = results.ROOT / "docs" / "data" / "compare_32px.jsonl"
    records = provenance.read_log(log) if log.exists() else []
    text = path.read_text()
    assert "<!-- compare.py:summary -->" in text
    blocks = compare.generated_blocks(records)
    assert results.refresh(text, {n: blocks[n] for n in compare.SUMMARY_FILES[path]}, tag="compare.py") == text, \
        f"{path.name}'s comparison summary is stale: run python extras/experiments/compare.py --table"


def test_summary_table_pairs_each_seed_with_its_own_random_init():
    lines = compare.summary_table(fake_comparison_records()).splitlines()
    assert lines[0].startswith("| backbone | method | 20-NN top-1 (%) | gain over its random init |")
    # seeds 0 and 1: 60 and 62 against a random init of 50 in both
    assert lines[2:] == ["| `vit_pico` | random init | 50.0 ± 0.0 | — | — | 0: no use in the ledger, "
                         "1: no use in the ledger |",
                         "| `vit_pico` | DINO | 61.0 ± 1.0 | +11.0 ± 1.0 | — | 0: no use in the ledger, "
                         "1: no use in the ledger |"]
    assert compare.summary_table([]) == "No test-phase run of the comparison on fashion_mnist is logged yet."


def test_learning_curves_are_drawn_from_a_fake_log(tmp_path):
    records = fake_comparison_records()
    series = curves.curve_series(records, "fashion_mnist", "test")
    # step 0: the row's own random init; 200: the kept checkpoint; 400: the final one; (mean, low, high) over seeds 0, 1
    assert series == {"vit_dino": {"seeds": [0, 1], "points": [
        (0, {"knn_top1": (50.0, 50.0, 50.0), "overlap_accuracy": (10.0, 10.0, 10.0)}),
        (200, {"knn_top1": (56.0, 55.0, 57.0), "overlap_accuracy": (15.0, 15.0, 15.0)}),
        (400, {"knn_top1": (61.0, 60.0, 62.0), "overlap_accuracy": (20.0, 20.0, 20.0)})]}}
    assert "mean of seeds 0, 1, bars: their range" in curves.curves_title(series, "fashion_mnist", "test", "recipe")
    longer = [{**r, "variant": "steps800", "steps": 800} for r in records if r["row"] == "vit_dino" and r["seed"] == 0]
    series = curves.curve_series(records + longer, "fashion_mnist", "test", "steps800")
    assert series["vit_dino"]["seeds"] == [0] and series["vit_dino"]["points"][::2] == [
        (0, {"knn_top1": (50.0, 50.0, 50.0), "overlap_accuracy": (10.0, 10.0, 10.0)}),   # the recipe's random init
        (800, {"knn_top1": (60.0, 60.0, 60.0), "overlap_accuracy": (20.0, 20.0, 20.0)})]
    assert "seed 0 only" in curves.curves_title(series, "fashion_mnist", "test", "steps800")
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    parser = curves.get_args_parser()
    picture = curves.main(parser.parse_args(["--log", str(log), "--output", str(out)]))
    assert out.is_file() and picture.dtype == torch.uint8 and picture.shape[0] == 3
    colour = torch.tensor(curves.ROW_STYLES["vit_dino"][0], dtype=torch.uint8)[:, None, None]
    assert ((picture == colour).all(dim=0)).sum() > 100        # the row's line and dots are drawn
    with pytest.raises(SystemExit):
        curves.main(parser.parse_args(["--log", str(log), "--data", "shapes", "--output", str(out)]))


def test_each_row_keeps_its_style_in_every_picture_and_overlapping_rows_differ():
    styles = curves.ROW_STYLES
    assert set(styles) == set(compare.METHOD_FLAGS)
    assert len({colour for colour, _, _ in styles.values()}) == len(styles)       # one colour per row
    assert styles["swin_glsd_similarity"][1] is not None and styles["swin_esvit"][1] is None   # dashed over solid
    assert styles["swin_glsd_similarity"][2] != styles["swin_esvit"][2]                        # and another marker


def test_pixels_knn_on_a_separable_toy_set():
    from PIL import Image

    class Toy:
        classes = ["left", "right"]     # which half of the image is bright

        def __init__(self, n):
            self.items = []
            for i in range(n):
                image = Image.new("RGB", (4, 4), (i, i, i))
                image.paste((200, 200, 200), (0, 0, 2, 4) if i % 2 == 0 else (2, 0, 4, 4))
                self.items.append((image, i % 2))

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    assert results.pixels_knn_by_k(Toy(40), Toy(10), (20,))[20] == 100.0


def test_comparison_pixel_row_reads_the_datasets_by_their_flags():
    top1 = compare.pixels_knn(["--dataset", "synthetic", "--synthetic_images", "40", "--synthetic_image_size", "16"])
    assert list(top1) == [10, 20]                                   # no k past the bank's 32 images
    assert all(0.0 <= v <= 100.0 for v in top1.values())


def test_drloc_regime_says_whether_the_papers_direction_holds():
    """Swin gains more than the ViT, and the short runs more than the long ones: a finding only
    where the mean gap exceeds both the seeds' spread and one evaluation's binomial error (0.71
    points at 50 % on 5000 images)."""
    top1 = {("swin", "recipe"): (3.0, 2.0), ("vit", "recipe"): (1.0, 0.5), ("swin", "short"): (4.0, 5.0),
            ("vit", "short"): (0.0, 1.0)}
    records = []
    for (arch, variant), gains in top1.items():
        for seed, gain in enumerate(gains):
            for run, value in ((f"drloc5k_{arch}", 50.0 + gain), (f"drloc5k_{arch}_base", 50.0)):
                records.append({"run": run, "variant": variant, "phase": "val", "seed": seed, "top1": value})
    text = results.drloc_regime(records)
    assert "- `swin`, 6 epochs: +2.50 (+3.00, +2.00; SE 0.71): finding" in text
    assert "a larger gain for the Swin than for the ViT (6 epochs): holds here" in text
    assert "the same sign with every seed" not in text                 # half the time by chance
    assert "(`swin`, 2 against 6 epochs): holds here (gap" in text      # +4.5 against +2.5
    assert "(`vit`, 2 against 6 epochs): not decided here (gap -0.25 (-1.00, +0.50; SE 0.71): " \
           "no finding)" in text    # +0.5 against +0.75
    def vit_recipe(r):
        return r["run"] == "drloc5k_vit" and r["variant"] == "recipe"
    # the gap 1.75 - 0.4 = 1.35: beyond the seeds' spread (0.25) and the binomial error (0.71)
    apart = [{**r, "top1": r["top1"] + 0.4 * vit_recipe(r)} for r in records]
    assert "than for the ViT (6 epochs): holds here" in results.drloc_regime(apart)
    # the gap 1.75 - 1.2 = 0.55: beyond the spread (0.25), not the binomial error
    close = [{**r, "top1": r["top1"] + 1.2 * vit_recipe(r)} for r in records]
    assert "than for the ViT (6 epochs): not decided here" in results.drloc_regime(close)
    assert results.drloc_regime(records[:2]).startswith("No paired difference yet")
    longer = [{**r, "variant": "epochs30", "top1": r["top1"] + (0.0 if r["run"].endswith("_base") else 1.0),
               "train_command": f"python drloc.py --epochs 6 --arch a --epochs 30 --seed {r['seed']}"}
              for r in records if r["variant"] == "recipe"]        # a longer variant: its --epochs, the last one
    other = [{**r, "variant": "lr", "top1": 0.0, "train_command": "python drloc.py --epochs 6 --lr 1"}
             for r in records if r["variant"] == "recipe"]             # another variant at the recipe's length
    text = results.drloc_regime(records + longer + other)
    assert "- `swin`, 30 epochs: +3.50 (+4.00, +3.00; SE 0.71): finding" in text
    assert "(`swin`, 6 against 30 epochs): the opposite holds here (gap -1.00" in text
    # each length against the next
    assert "(`swin`, 2 against 6 epochs): holds here (gap +2.00" in text
    assert "2 against 30 epochs" not in text
    assert "a larger gain for the Swin than for the ViT (30 epochs): holds here" in text
    assert "- `swin`, 6 epochs: +2.50 (+3.00, +2.00; SE 0.71): finding" in text       # the recipe's, not `lr`'s
    assert "test split" not in text
    tested = [{**r, "phase": "test", "top1": r["top1"] - (1.0 if r["run"] == "drloc5k_vit" else 0.0)}
              for r in longer if "vit" in r["run"]]                 # one backbone run once on the test split
    text = results.drloc_regime(records + longer + other + tested)
    # test pairs never enter the validation lines
    assert text.splitlines()[-2] == ("- the test split (its first 5000 images), `vit`, 30 epochs: "
                                     "+0.75 (+1.00, +0.50; SE 0.71): finding")
    assert "a larger gain for the Swin than for the ViT (30 epochs): holds here" in text
    shapes = [{**r, "variant": "shapes30", "top1": r["top1"] + (0.0 if r["run"].endswith("_base") else 2.0),
               "train_command": f"python drloc.py --dataset fashion_mnist --epochs 30 --dataset synthetic --seed {r['seed']}"}
              for r in longer]                                          # the same length on a second dataset
    text = results.drloc_regime(records + longer + other + shapes)
    assert "- `swin`, 30 epochs: +3.50 (+4.00, +3.00; SE 0.71): finding" in text     # Fashion-MNIST's pair stays its own
    assert "- `swin`, 30 epochs, shapes: +5.50 (+6.00, +5.00; SE 0.71): finding" in text
    assert ("a larger gain for the Swin than for the ViT (30 epochs, shapes): holds here "
            "(gap +1.75") in text
    # within Fashion-MNIST only
    assert "(`swin`, 6 against 30 epochs): the opposite holds here (gap -1.00" in text
    assert "against 30 epochs, shapes" not in text and "30 against 30" not in text


def test_a_resumed_run_is_logged_without_a_train_time(tmp_path, monkeypatch):
    """A run stopped part-way and started again resumes from its checkpoint: the wall time of that last
    process is not its training's, so its line says `resumed`, holds no train time, and the table shows —."""
    def training(cmd, log_path):
        out = Path(log_path).parent
        (out / "args.json").write_text(json.dumps({"epochs": 2}))
        (out / "log.txt").write_text("".join(json.dumps({"epoch": e, "peak_memory_mb": 1.0, "val_acc1": 50.0}) + "\n"
                                             for e in range(2)))
        return ""
    monkeypatch.setattr(provenance, "run", training)
    fresh = results.train_and_evaluate_unstamped("drloc5k_vit", "recipe", "", "val", 0, tmp_path / "fresh")
    stopped = tmp_path / "stopped" / "drloc5k_vit_recipe_val_seed0"
    stopped.mkdir(parents=True)
    (stopped / "checkpoint.pth").write_bytes(b"")          # what a SIGTERM'd run leaves behind
    resumed = results.train_and_evaluate_unstamped("drloc5k_vit", "recipe", "", "val", 0, tmp_path / "stopped")
    assert "train_seconds" in fresh and "resumed" not in fresh
    assert resumed["resumed"] is True and "train_seconds" not in resumed
    fresh, resumed = ({**r, "utc": "2026-11-27T10:00:00Z"} for r in (fresh, resumed))
    assert results.table([fresh], "val").splitlines()[-1].split(" | ")[6] != "—"
    assert results.table([fresh, {**resumed, "seed": 1}], "val").splitlines()[-1].split(" | ")[6] == "—"


def test_a_training_stopped_by_a_preemption_signal_is_neither_evaluated_nor_logged(tmp_path, monkeypatch):
    """A method script that receives SIGTERM writes its checkpoint and exits 0 (to be resumed): the
    drivers read its log.txt and refuse to evaluate or log the half-trained network."""
    calls = []

    def preempted_training(cmd, log_path):
        calls.append(cmd)
        out = Path(log_path).parent
        (out / "args.json").write_text(json.dumps({"epochs": 8, "precision": "fp32"}))
        (out / "log.txt").write_text("".join(json.dumps({"epoch": e, "peak_memory_mb": 1.0}) + "\n" for e in range(3)))
        log_path.write_text("received SIGTERM: checkpoint written to ...; run the same command again to resume\n")
        return log_path.read_text()
    monkeypatch.setattr(provenance, "run", preempted_training)
    args = compare.get_args_parser().parse_args(["--work_dir", str(tmp_path), "--rows", "swin_dino"])
    with pytest.raises(SystemExit, match=r"stopped after 3 of 8 epochs .*run the same command again"):
        compare.run_row("swin_dino", args, 0)
    assert len(calls) == 1 and "dino.py" in calls[0][1]          # the training ran; no evaluation after it
    out = Path(calls[0][-1])
    with pytest.raises(SystemExit, match="stopped after 3 of 8 epochs"):
        provenance.check_trained(["python", "dino.py"], out)
    (out / "log.txt").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in range(8)))
    provenance.check_trained(["python", "dino.py"], out)             # the last epoch logged: finished
    (out / "log.txt").write_text("not json\n")
    with pytest.raises(SystemExit, match="no readable args.json / log.txt"):
        provenance.check_trained(["python", "dino.py"], out)


def test_train_times_of_seeds_on_different_thread_counts_are_shown_per_seed():
    one, two = ({"train_seconds": 600.0, "machine": {"threads": 1}}, {"train_seconds": 330.0, "machine": {"threads": 2}})
    assert compare.compare_tables.train_minutes([one, {**one, "train_seconds": 720.0}]) == "11.0 ± 1.0"
    assert compare.compare_tables.train_minutes([one, two]) == "10.0 (1 thread), 5.5 (2 threads)"
    assert compare.compare_tables.train_minutes([one, {"knn_top1": 1.0}]) == "—"


def test_the_readme_glance_at_long_runs_shows_only_rows_run_on_both_splits():
    records = fake_comparison_records()               # vit_dino 60 and 62 (test), 1.0 (val); pixels 84.59 (test)
    long = [{**{k: v for k, v in r.items() if k != "train_seconds"}, "steps": 1600, "variant": "steps1600"}
            for r in records if r["row"] == "vit_dino"]                        # resumed runs log no train time
    long = [{**r, "train_seconds": 5400.0, "machine": {"threads": 2}} if r["phase"] == "val" else r for r in long]
    glance = compare.compare_tables.long_glance_table
    assert glance(records + [r for r in long if r["phase"] == "test"]).startswith("No row longer than 400 steps")
    lines = glance(records + long).splitlines()
    assert len(lines) == 3 and lines[2].split(" | ")[1:] == [
        "DINO", "1600", "1, 2", "61.0 ± 1.0", "-23.6 ± 1.0 (-24.59, -22.59)",
        "0: no use in the ledger, 1: no use in the ledger", "90.0 (val 0, 2 threads) |"]
