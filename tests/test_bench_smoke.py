"""extras/perf/bench.py keeps working: two methods for one warm-up and one counted step of their own
train_one_epoch, and the quick start's side-by-side comparison on a few synthetic images; every
number positive, the tables printed."""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extras" / "perf"))
import bench  # noqa: E402


def test_bench_rows_time_the_methods_own_training(capsys):
    rows = bench.main(["--methods", "dino", "drloc", "--precisions", "fp32", "--device", "cpu", "--warmup", "1",
                       "--steps", "1", "--batch_size", "4"])["rows"]
    assert [(r["method"], r["precision"]) for r in rows] == [("dino", "fp32"), ("drloc", "fp32")]
    for r in rows:
        assert 0 < r["min"] <= r["median"] <= r["max"] and 0 <= r["wait"] <= r["max"]
        assert r["images_per_s"] == 4 / r["median"] and math.isfinite(r["loss"])
        assert r["memory"] is None or r["memory"] > 0
    out = capsys.readouterr().out
    assert "| dino | fp32 | " in out and "| drloc | fp32 | " in out and "1.00x |" in out
    auto = "bf16" if bench.auto_precision(torch.device("cpu")).startswith("precision: bf16") else "fp32"
    assert f"--precision auto here: {auto} (" in out


def test_a_refused_row_is_skipped_with_its_reason(capsys):
    rows = bench.main(["--methods", "selfpatch", "--arch", "swin_pico", "--precisions", "fp32", "--device", "cpu",
                       "--warmup", "1", "--steps", "1", "--batch_size", "2"])["rows"]
    assert rows == []
    assert "selfpatch --precision fp32: skipped (" in capsys.readouterr().out


def test_quickstart_side_by_side_on_synthetic_images(capsys):
    results = bench.main(["--recipe", "quickstart", "--device", "cpu", "--recipe_rounds", "1", "--recipe_steps", "1",
                          "--recipe_workers", "1", "--recipe_flags",
                          "--dataset synthetic --synthetic_images 24 --synthetic_image_size 28 --batch_size_per_gpu 8"])
    results = results["recipe"]
    assert list(results) == ["PIL crops, 1 loader worker", "batched crops, no loader worker"]
    for r in results.values():
        assert r["steps"] == 1 and r["median"] > 0 and r["cpu"] > 0 and r["images_per_s"] == 8 / r["median"]
    # the same weights, data and random draws: the batched crops differ from PIL's by rounding only
    losses = [r["loss"] for r in results.values()]
    assert abs(losses[0] - losses[1]) < 1e-2
    out = capsys.readouterr().out
    assert "| PIL crops, 1 loader worker | " in out and "| batched crops, no loader worker | " in out
    assert "batched crops, no loader worker: " in out and "x the images/s of the fastest PIL configuration" in out
