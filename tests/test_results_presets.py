"""tests/results.py (the README's Fashion-MNIST table) is not run by CI: its presets take hours.
Check here that every preset still parses with its script's own arguments, and the table."""
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402


@pytest.mark.parametrize("name", [n for n, (script, _, _) in results.RUNS.items() if script])
def test_preset_parses_with_its_script(name):
    script, flags, _ = results.RUNS[name]
    module = importlib.import_module(script[:-3])
    args = module.get_args_parser().parse_args(flags.split())
    assert args.dataset == "fashion_mnist"


def test_table_reports_mean_and_half_range_per_run():
    records = [{"run": "dino", "seed": 0, "top1": 60.0, "train_seconds": 600, "peak_memory_mb": 900},
               {"run": "dino", "seed": 1, "top1": 64.0, "train_seconds": 660, "peak_memory_mb": 950},
               {"run": "random_vit", "seed": 0, "top1": 50.0, "train_seconds": 0.0, "peak_memory_mb": None}]
    lines = results.table(records).splitlines()
    assert lines[2] == "| random_vit | 1 | 50.0 ± 0.0 | 0.0 | — |"
    assert lines[3] == "| dino | 2 | 62.0 ± 2.0 | 10.5 | 950 |"


def test_table_shows_the_esvit_runs_for_the_glsd_settings_that_train_identically():
    records = [{"run": "esvit", "seed": 0, "top1": 80.0, "train_seconds": 60, "peak_memory_mb": 900},
               {"run": "glsd_geometric", "seed": 0, "top1": 81.0, "train_seconds": 60, "peak_memory_mb": 900}]
    lines = results.table(records).splitlines()
    assert lines[2:] == ["| esvit | 1 | 80.0 ± 0.0 | 1.0 | 900 |",
                         "| glsd_similarity (= esvit) | 1 | 80.0 ± 0.0 | 1.0 | 900 |",
                         "| glsd_geometric | 1 | 81.0 ± 0.0 | 1.0 | 900 |"]
