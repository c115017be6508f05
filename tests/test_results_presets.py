"""tests/results.py (docs/RESULTS.md's Fashion-MNIST tables) is not run by CI: its recipes take CPU-hours.
Check here that every recipe still parses with its script's own arguments, and the table."""
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402


@pytest.mark.parametrize("name", [n for n, (script, _) in results.RUNS.items() if script])
def test_recipe_parses_with_its_script(name):
    script, flags = results.RUNS[name]
    module = importlib.import_module(script[:-3])
    args = module.get_args_parser().parse_args(flags.split())
    assert args.dataset == "fashion_mnist"
    assert (args.global_crop_size if script != "drloc.py" else args.input_size) in (28, 32)


def test_table_reports_mean_half_range_and_gain_over_random_init_per_phase():
    records = [{"run": "dino", "variant": "recipe", "phase": "test", "seed": 0, "top1": 60.0, "random_init_top1": 50.0,
                "train_seconds": 600, "peak_memory_mb": 900},
               {"run": "dino", "variant": "recipe", "phase": "test", "seed": 1, "top1": 64.0, "random_init_top1": 52.0,
                "train_seconds": 660, "peak_memory_mb": 950},
               {"run": "dino", "variant": "recipe", "phase": "val", "seed": 0, "top1": 1.0, "random_init_top1": 1.0,
                "train_seconds": 60, "peak_memory_mb": 900},
               {"run": "pixels", "variant": "recipe", "phase": "test", "seed": 0, "top1": 84.6, "train_seconds": 0.0}]
    lines = results.table(records, "test").splitlines()
    assert lines[2:] == ["| dino | recipe | 2 | 62.0 ± 2.0 | 51.0 ± 1.0 | 11.0 ± 1.0 | 10.5 | 950 |",
                         "| raw pixels | — | — | 84.6 | — | — | — | — |"]


def test_drloc_comparison_is_paired_by_seed():
    records = [{"run": run, "variant": "recipe", "phase": "test", "seed": seed, "top1": top1}
               for run, seed, top1 in [("drloc", 0, 50.0), ("drloc", 1, 54.0), ("drloc", 2, 52.0), ("drloc", 3, 99.0),
                                       ("drloc_base", 0, 49.0), ("drloc_base", 1, 51.0), ("drloc_base", 2, 52.0)]]
    line = results.paired_difference(records, "test")
    # seed 3 has no baseline: differences +1, +3, 0 -> mean 1.33, std 1.53, 2 s.e. = 1.76
    assert "(3 seeds: +1.00, +3.00, +0.00): +1.33 ± 1.53 points" in line and line.endswith("within two standard errors of the mean")
    assert "beyond" in results.paired_difference([{**r, "top1": r["top1"] + 5 * (r["run"] == "drloc")} for r in records], "test")
    assert results.paired_difference(records[:1] + records[4:5], "test") is None


def test_results_md_is_what_table_generates_from_the_log():
    """docs/RESULTS.md's tables and commands are `results.py --table`'s output for the committed log."""
    committed = results.RESULTS_MD.read_text()
    records = results.read_log(results.ROOT / "tests" / "results_32px.jsonl")
    assert "<!-- results.py:test -->" in committed and "<!-- results.py:commands -->" in committed
    assert results.refresh(committed, results.generated_blocks(records)) == committed, \
        "docs/RESULTS.md is stale: run python tests/results.py --table"


def test_each_listed_command_trains_what_its_logged_runs_trained():
    """The recipe as it stands plus the command's --extra parses to the logged run's arguments."""
    for record in results.read_log(results.ROOT / "tests" / "results_32px.jsonl"):
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
