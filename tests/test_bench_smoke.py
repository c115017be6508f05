"""extras/bench.py keeps working: one method, one warm-up and one timed step, every number positive."""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extras"))
import bench  # noqa: E402


def test_bench_one_method_one_step(capsys):
    result = bench.main(["--methods", "glsd_geometric", "--precisions", "fp32", "--warmup", "1", "--steps", "1",
                         "--peak_seconds", "0.1", "--data_images", "4", "--data_passes", "1"])
    (row,) = result["rows"]
    assert row["method"] == "glsd_geometric" and row["precision"] == "fp32"
    assert result["peaks"]["fp32"] > 0
    assert 0 < row["min"] <= row["median"] <= row["max"]
    assert row["images_per_s"] > 0 and row["memory"] > 0
    assert row["flops"] > row["attention_flops"] > 0          # vit_pico's attention goes through SDPA
    for part in ("backbone", "heads", "update", "extra"):     # geometric matching is GLSD's own extra work
        assert 0 < row[part] < 5, part
    assert len(row["losses"]) == 1 and math.isfinite(row["losses"][0])
    assert [d["crops"] for d in result["data"]] == ["2 x 64 + 4 x 32", "2 x 224 + 8 x 96"]
    assert all(d["repo"] > 0 and d["reference"] > 0 for d in result["data"])
    out = capsys.readouterr().out
    assert "| glsd_geometric | fp32 |" in out and "dense matmul peak (best before and after the rows): fp32" in out
    assert f"CPU capability (torch): {torch.backends.cpu.get_cpu_capability()}; native bf16 on cpu: " in out
    assert f"--precision auto would train in {'bf16' if bench.common.cpu_has_native_bf16() else 'fp32'} (" in out
