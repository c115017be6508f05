"""extras/perf/side_by_side.py, the authors' DINO beside ours: the parts that need no code of the
authors (a user's clone has none, and no test reads it). Our side's steps alone and end to end on
JPEGs, with the fused-AdamW lever; the FLOP count against the ViT's own arithmetic; the peak
table; the JSON line and its provenance; the shims that run the authors' step, and the refusal of
a folder without their files. The full smoke run with their code is run by hand:
`python extras/perf/side_by_side.py --authors_code DIR --device cpu --smoke`."""
import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "extras" / "perf")]
import side_by_side  # noqa: E402

CPU = torch.device("cpu")
# vit_pico (64 wide, 4 blocks, 2 heads), 8 px patches, 32 and 16 px crops, a small head
SPEC = dict(arch="vit_pico", patch_size=8, out_dim=64, hidden_dim=32, bottleneck_dim=16,
            global_size=32, local_size=16, local_crops=2)


@pytest.fixture
def group_of_one():
    """A gloo process group of one, as side_by_side.main makes (both sides run in DDP); ended
    after the test, so that no other test runs inside it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def check_figures(figures, steps, batch):
    assert figures["steps"] == steps and figures["images"] == steps * batch
    assert figures["images_per_s"] * figures["wall_s"] == pytest.approx(steps * batch)
    waited = figures["wait_share"] * figures["wall_s"]
    assert figures["mean_wait_s"] * steps == pytest.approx(waited)
    assert math.isfinite(figures["loss"]) and figures["median_step_s"] > 0
    assert figures["peak_memory_mb"] is None                  # CPU: no per-measurement peak


def test_our_step_alone_and_the_levers_build_and_take_steps(group_of_one, tmp_path, monkeypatch):
    """dino.py's model, loss and train_one_epoch on one batch repeated, timed by the clock (a
    warm-up step left out); fused AdamW is asked for, and the compiled backbones are built. A
    compiled step is not taken here: its first step compiles, 142 s for vit_pico on a busy 2-core
    CPU (more than the 30 s this suite allows a lever)."""
    fused = []
    plain_adamw = torch.optim.AdamW

    class Recorded(plain_adamw):
        def __init__(self, params, **kwargs):
            fused.append(kwargs.get("fused"))
            super().__init__(params, **kwargs)
    monkeypatch.setattr(side_by_side.torch.optim, "AdamW", Recorded)
    crops = side_by_side.random_crops(SPEC, 2, CPU)
    assert [tuple(c.shape) for c in crops] == [(2, 3, 32, 32)] * 2 + [(2, 3, 16, 16)] * 2
    for lever in (None, "fused_adamw"):
        args = side_by_side.our_args(SPEC, 2, "fp32", CPU, str(tmp_path))
        train, _ = side_by_side.build_ours(args, CPU, 3, lever)
        clock = side_by_side.Clock([((crops, []), None)], 3, CPU, every_step=True)
        check_figures(side_by_side.measure(train, clock, CPU, 1, 2), steps=2, batch=2)
    assert fused == [None, True]
    args = side_by_side.our_args(SPEC, 2, "bf16", CPU, str(tmp_path))
    _, (student, teacher) = side_by_side.build_ours(args, CPU, 3, "compile")
    assert student.backbone._compiled_call_impl and teacher.backbone._compiled_call_impl
    assert student.head._compiled_call_impl is None
    # the EMA pairs the parameters by name: compiled in place, they keep them
    names = [n for n, _ in student.named_parameters()]
    assert names == [n for n, _ in teacher.named_parameters()] and "backbone.cls_token" in names
    # counted as the plain network is, without compiling (force_eager)
    crops = side_by_side.random_crops(SPEC, 2, CPU)
    assert side_by_side.flops_per_image(student, teacher, crops) == side_by_side.flops_per_image(
        *side_by_side.build_ours(args, CPU, 3)[1], crops)
    torch._dynamo.reset()


def test_our_end_to_end_runs_on_jpegs_with_both_crop_paths(group_of_one, tmp_path):
    """dino.py's loader on jpeg_folder.py's files (PIL crops and --batched_crops, no worker: the
    decoding and cropping are the data wait), for a warm-up step and two measured ones."""
    folder = side_by_side.jpeg_folder.make(tmp_path / "jpeg", 8, classes=2, size=64, processes=1)
    spec = {**SPEC, "global_size": 32, "local_size": 16}
    for batched in ("false", "true"):
        flags = ["--dataset", "folder", "--data_path", str(folder), "--num_workers", "0",
                 "--batched_crops", batched]
        args = side_by_side.our_args(spec, 2, "fp32", CPU, str(tmp_path), flags)
        train, _ = side_by_side.build_ours(args, CPU, 3)
        loader = side_by_side.our_loader(args, CPU)
        assert hasattr(loader.dataset, "collate") == (batched == "true")  # device_crops' batches
        clock = side_by_side.Clock(loader, 3, CPU, every_step=False)
        figures = side_by_side.measure(train, clock, CPU, 1, 2)
        check_figures(figures, steps=2, batch=2)
        assert figures["mean_wait_s"] > 0


def test_flops_per_image_are_the_vits_and_heads_matrix_products():
    """FlopCounterMode over one image, attention included (its explicit products), equals the
    count by hand: per block 24 N d^2 + 4 N^2 d, the patch embedding, the head's four layers;
    3x the student's forward on every crop plus the teacher's on the two global crops."""
    args = side_by_side.our_args(SPEC, 2, "fp32", CPU, "unused")
    student = side_by_side.dino.build_model(args, 0.1)
    teacher = side_by_side.dino.build_model(args, 0.0)
    crops = side_by_side.random_crops(SPEC, 2, CPU)
    d, depth, p = 64, 4, 8
    head = 2 * (d * 32 + 32 * 32 + 32 * 16 + 16 * 64)

    def crop(size):
        patches = (size // p) ** 2
        n = patches + 1
        return 2 * patches * 3 * p * p * d + depth * (24 * n * d * d + 4 * n * n * d) + head
    by_hand = 3 * (2 * crop(32) + 2 * crop(16)) + 2 * crop(32)
    assert side_by_side.flops_per_image(student, teacher, crops) == by_hand


def test_the_peak_table_names_its_gpu_and_leaves_others_unknown(monkeypatch):
    cuda = torch.device("cuda")
    for name, bf16 in (("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("Tesla V100-SXM2-32GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert side_by_side.peak_flops(cuda, "bf16") == bf16
        assert side_by_side.peak_flops(cuda, "fp32") is None
    assert side_by_side.peak_flops(CPU, "bf16") is None
    record = {"measure": "step_alone", "code": "ours", "precision": "bf16", "batch_per_gpu": 64,
              "median_step_s": 0.069, "mfu": None, "loss": 11.1}
    assert "MFU unknown" in side_by_side.line_text(record)
    record.update(mfu=0.31, peak_tflops=989)
    assert "MFU 31.0% of 989 TFLOP/s" in side_by_side.line_text(record)
    assert "FAILED: OutOfMemoryError" in side_by_side.line_text({**record, "error":
                                                                 "OutOfMemoryError: CUDA"})


def test_a_measurement_is_one_json_line_with_its_provenance(tmp_path):
    out = tmp_path / "side_by_side.jsonl"
    record = {"measure": "step_alone", "code": "authors", "precision": "fp16", "lever": None,
              "batch_per_gpu": 64, "median_step_s": 0.08}
    started = side_by_side.provenance.start()
    for _ in range(2):
        side_by_side.write_line(out, record, started, "NVIDIA H200 (143,771 MiB)",
                                "python extras/perf/side_by_side.py --authors_code x")
    lines = side_by_side.provenance.read_log(out, required=("measure", "utc", "commit"))
    assert len(lines) == 2 and lines[0] == lines[1] | {"utc": lines[0]["utc"]}
    line = lines[0]
    assert (line["device"], line["command"]) == (
        "NVIDIA H200 (143,771 MiB)", "python extras/perf/side_by_side.py --authors_code x")
    assert {"started_utc", "uncommitted", "machine"} <= set(line) and line["machine"]["cores"]
    assert {k: line[k] for k in record} == record
    assert json.loads(out.read_text().splitlines()[0]) == line


def test_the_shims_run_the_authors_step_in_the_precision_measured_and_restore_torch():
    """Their `torch.cuda.amp.autocast(enabled)` takes the measured dtype (on any device); on a CPU
    their `.cuda()`, `torch.cuda.synchronize()` and MetricLogger's CUDA all-reduce do nothing;
    everything is as before afterwards."""
    class Utils:
        @staticmethod
        def is_dist_avail_and_initialized():
            return True
    authors = argparse.Namespace(utils=Utils)
    shims = side_by_side.authors_dino.shims
    before = (torch.cuda.amp.autocast, torch.Tensor.cuda, torch.cuda.synchronize,
              Utils.is_dist_avail_and_initialized)
    x = torch.ones(2, 2)
    with shims(authors, CPU, "bf16"):
        assert x.cuda(non_blocking=True) is x and torch.cuda.synchronize() is None
        assert not Utils.is_dist_avail_and_initialized()
        with torch.cuda.amp.autocast(True):
            assert (x @ x).dtype == torch.bfloat16
        with torch.cuda.amp.autocast(False):
            assert (x @ x).dtype == torch.float32
    with shims(authors, CPU, "fp32"), torch.cuda.amp.autocast(True):
        assert (x @ x).dtype == torch.float32                 # their fp32 run: no autocast
    assert (torch.cuda.amp.autocast, torch.Tensor.cuda, torch.cuda.synchronize,
            Utils.is_dist_avail_and_initialized) == before


def test_a_folder_without_the_authors_files_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "main_dino.py").write_text("")
    with pytest.raises(SystemExit) as stop:
        side_by_side.main(["--authors_code", str(tmp_path), "--device", "cpu", "--smoke",
                           "--out", str(tmp_path / "out.jsonl")])
    message = str(stop.value.code)
    assert message.startswith("error: --authors_code") and len(message.splitlines()) == 1
    assert "utils.py, vision_transformer.py" in message and not (tmp_path / "out.jsonl").exists()


def test_gpu_run_steps_parse_with_each_scripts_parser_and_it_refuses_without_the_authors_code(
        tmp_path):
    """The one GPU script's three steps, parsed by their own scripts' parsers, sharing one JPEG
    cache and writing the files to commit under --docs; without the authors' files it stops in
    one line before anything runs."""
    import decode_check
    import gpu_check
    import gpu_run
    parsers = {"decode_check": decode_check.get_args_parser(),
               "gpu_check": gpu_check.get_args_parser(), "loader_cost":
               side_by_side.jpeg_folder.get_args_parser(),
               "side_by_side": side_by_side.get_args_parser()}
    for device in ("cuda", "cpu"):
        args = gpu_run.get_args_parser().parse_args(
            ["--device", device, "--out", str(tmp_path / "run"), "--docs", str(tmp_path / "d")])
        steps = dict(gpu_run.steps(args))
        assert list(steps) == ["decode_check", "gpu_check", "loader_cost", "side_by_side"]
        parsed = {name: parsers[name].parse_args(cmd[2:]) for name, cmd in steps.items()}
        assert {parsed["gpu_check"].jpeg_cache, parsed["loader_cost"].cache,
                parsed["side_by_side"].jpeg_cache,
                parsed["decode_check"].jpeg_cache} == {"runs/jpeg_folders"}
        assert parsed["side_by_side"].batches == [128] and parsed["side_by_side"].e2e_batch == 128
        assert parsed["side_by_side"].levers[0] == "fused_adamw"  # the cheap lever first
        assert parsed["gpu_check"].out == str(tmp_path / "run" / "gpu_check")  # main adds a time
        assert parsed["side_by_side"].out == str(tmp_path / "d" / "side_by_side.jsonl")
        assert parsed["side_by_side"].authors_code == ".authors_dino"
        assert parsed["side_by_side"].smoke == (device == "cpu")
        assert parsed["loader_cost"].cost > 0 and parsed["gpu_check"].device == device
        assert parsed["loader_cost"].log == str(tmp_path / "d" / "loader_cost.jsonl")
    with pytest.raises(SystemExit) as stop:
        gpu_run.main(["--authors_code", str(tmp_path / "none"), "--out", str(tmp_path / "run"),
                      "--docs", str(tmp_path / "d")])
    assert str(stop.value.code).startswith("error: --authors_code")
    assert len(str(stop.value.code).splitlines()) == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "d").exists()
    assert not list(tmp_path.iterdir())
