"""extras/perf/gpu_check.py, the first GPU run in one command. Its CPU form runs here (every part,
tiny models, gloo; about a minute on a busy 2-core CPU); its GPU form's commands are parsed by the
scripts' own parsers; its sync counter counts what would make the host wait for a GPU, and every
training step keeps to the one host sync per step that docs/FIRST_GPU_RUN.md states; each training
part's figures (mean data wait, epoch images/s) are recorded and agree with its line."""
import importlib
import json
import math
import multiprocessing.pool
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "extras" / "perf"))
import common  # noqa: E402
import gpu_check  # noqa: E402


def test_gpu_form_commands_parse_with_the_scripts_own_parsers_at_paper_size(tmp_path):
    for gpus in (1, 2, 8):
        parts = gpu_check.plan("gpu", gpus, tmp_path)
        gpu_check.check_commands(parts)     # a flag a script refuses stops here, in one line
        assert ("dino_two_processes" in {p.name for p in parts}) == (gpus >= 2)
    parts = {p.name: p for p in gpu_check.plan("gpu", 2, tmp_path)}
    for method, arch, batch in (("dino", "vit_small", 64), ("esvit", "swin_tiny", 32),
                                ("glsd", "swin_tiny", 32), ("selfpatch", "vit_small", 64),
                                ("drloc", "swin_tiny", 128)):
        args = importlib.import_module(method).get_args_parser().parse_args(parts[method].argv)
        assert (args.arch, args.batch_size_per_gpu, args.precision, args.device,
                args.synthetic_image_size) == (arch, batch, "auto", "auto", 256)
        assert (args.epochs, args.max_steps_per_epoch, args.synthetic_images) == (2, 25, 25 * batch)
        if method != "drloc":               # the papers' crops and heads: the scripts' defaults
            assert (args.global_crop_size, args.local_crop_size, args.local_crops_number,
                    args.out_dim, args.head_hidden_dim, args.patch_size) == \
                (224, 96, 8, 65536, 2048, 16)
        assert parts[method].sync_window == (5, 10)
    assert parts["dino_preempted"].preempt_at == 10 and parts["dino_two_processes"].nproc == 2
    folder = gpu_check.jpeg_folder.folder_for("runs/jpeg_folders", 4000, size=500)
    for name, batched in (("dino_jpeg", False), ("dino_jpeg_batched", True)):
        args = importlib.import_module("dino").get_args_parser().parse_args(parts[name].argv)
        # the scripts' default loader on files: multi-crop, batch, 10 workers; 2 epochs of 40 steps
        assert (args.dataset, args.data_path, args.num_workers, args.batched_crops) == \
            ("folder", str(folder), 10, batched)
        assert (args.global_crop_size, args.local_crop_size, args.local_crops_number,
                args.batch_size_per_gpu, args.max_steps_per_epoch, args.epochs) == \
            (224, 96, 8, 64, 40, 2)
    assert parts["dino_two_processes"].env == {"NVIDIA_TF32_OVERRIDE": "0"}
    wrong = parts["dino"]
    wrong.argv = [*wrong.argv, "--no_such_flag"]
    with pytest.raises(SystemExit,
                       match="^error: part dino: dino.py unrecognized arguments: --no_such_flag"):
        gpu_check.check_commands([wrong])


def test_sync_counter_counts_what_would_wait_for_a_gpu():
    x = torch.arange(6.0)
    original = torch.Tensor.tolist
    with gpu_check.SyncCounter() as counter:
        x.sum().item(), bool(x.sum() > 0), float(x[0]), x.tolist(), x[x > 2], x.nonzero()  # 6 reads
        torch.tensor([1.0], device="cpu"), x.to("cpu"), x.cpu()                  # 3 blocking copies
        x.to("cpu", non_blocking=True), x.to(torch.float64), x + 1                        # none
        torch.zeros(2, device="cpu"), x[torch.tensor([0, 1])], x.float().mean()           # none
    assert counter.count == 9, counter.sites
    assert len(counter.sites) == 2
    assert {site.split(":")[0] for site in counter.sites} == {"tests/test_gpu_check.py"}
    assert torch.Tensor.tolist is original


def test_cuda_count_takes_only_cudas_sync_warnings_and_names_their_lines(monkeypatch):
    """On a GPU the counter also counts CUDA's own warnings (`set_sync_debug_mode(1)`). Faked here:
    turning the mode on makes torch warn once that it is a prototype, which the first GPU run (H200)
    took for a sync; only 'called a synchronizing CUDA operation' counts, named by the line that
    made the call."""
    def set_mode(mode):
        if mode:
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    shown = warnings.showwarning

    def synchronising_call():
        warnings.warn(gpu_check.CUDA_SYNC)
    # the prototype warning: shown, not counted
    with pytest.warns(UserWarning, match="prototype"), gpu_check.SyncCounter() as counter:
        synchronising_call(), synchronising_call()
        with pytest.warns(UserWarning, match="another warning"):  # other warnings pass through
            warnings.warn("another warning")
    line = synchronising_call.__code__.co_firstlineno + 1
    assert counter.cuda == 2 and counter.cuda_sites == {f"tests/test_gpu_check.py:{line}": 2}
    assert warnings.showwarning is shown


def test_step_figures_show_a_bursty_loader_that_the_median_hides():
    """A loader at about half the GPU's speed, whose workers deliver in bursts: three batches
    waiting, then a wait of 260 ms. The median wait is 0; the mean wait and the epoch's images/s
    show it, and the sync counter's steps and the warm-up are left out."""
    steps = [(5.0, 0.069)] + [(0.0, 0.069), (0.0, 0.069), (0.0, 0.069), (0.260, 0.069)] * 4
    steps[3] = (9.0, 9.0)                                     # a counted step: not timed
    figures = gpu_check.step_figures(steps, warmup=1, skipped=(3, 4), images_per_step=64)
    assert figures["steps"] == 15 and figures["images"] == 15 * 64
    assert figures["median_wait_s"] == 0 and figures["median_step_s"] == pytest.approx(0.069)
    assert figures["mean_wait_s"] == pytest.approx(4 * 0.260 / 15)
    assert figures["wall_s"] == pytest.approx(15 * 0.069 + 4 * 0.260)
    assert figures["images_per_s"] * figures["wall_s"] == pytest.approx(15 * 64)
    assert figures["images_per_s"] < 0.55 * 64 / 0.069       # not the 928 img/s of the median
    assert figures["wait_share"] == pytest.approx(4 * 0.260 / figures["wall_s"])
    assert gpu_check.step_figures(steps[:1], warmup=1, skipped=(0, 0), images_per_step=64) is None


def test_jpeg_folder_is_made_once_reused_and_read_by_the_scripts_loader(tmp_path):
    """ImageNet-like JPEGs (landscape and portrait around the nominal size, in class folders), made
    in worker processes; a complete folder is reused as it is, one stopped half-way is made
    again; the training scripts' ImageFolder reads every file."""
    jpeg_folder = gpu_check.jpeg_folder
    folder = jpeg_folder.make(tmp_path, 24, classes=3, size=100, processes=2)
    assert folder == jpeg_folder.folder_for(tmp_path, 24, classes=3, size=100)
    described = jpeg_folder.describe(folder)
    assert described["images"] == 24 and 0 < described["portrait"] < 24
    assert 80 <= described["mean_width"] <= 128 and 60 <= described["mean_height"] <= 128
    dataset = common.ImageFolderSafe(str(folder))
    assert len(dataset) == 24 and len(dataset.classes) == 3
    assert all(int(Path(path).stem) % 3 == label for path, label in dataset.samples)
    image, _ = dataset[5]
    assert image.mode == "RGB" and image.size == Image.open(dataset.samples[5][0]).size
    again = jpeg_folder.make(tmp_path, 24, classes=3, size=100, processes=2)  # reused, not made
    assert again == folder and (folder / jpeg_folder.MARKER).stat().st_mtime_ns == \
        (again / jpeg_folder.MARKER).stat().st_mtime_ns
    first = (folder / "class00" / "000000.jpg").read_bytes()
    (folder / jpeg_folder.MARKER).unlink()                   # as if stopped before the end
    jpeg_folder.make(tmp_path, 24, classes=3, size=100, processes=1)
    assert (folder / jpeg_folder.MARKER).is_file()
    assert (folder / "class00" / "000000.jpg").read_bytes() == first   # the same images
    assert jpeg_folder.describe(folder)["images"] == 24
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_jpeg_folder_is_made_in_a_process_whose_sigterm_means_checkpoint(tmp_path, monkeypatch):
    """Its forked image makers end by their queue, never by `Pool.terminate`'s SIGTERM: in a
    process that installed common's preemption handler (a test run's) they take it as "write a
    checkpoint" and stay, and the pool waited for them for ever (the CI run hung there)."""
    def terminate(pool):
        raise AssertionError("the image makers were sent SIGTERM (Pool.terminate)")
    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", terminate)
    previous = {sig: signal.getsignal(sig) for sig in common.PREEMPTION_SIGNALS}
    common.install_preemption_handler()
    try:
        folder = gpu_check.jpeg_folder.make(tmp_path, 4, classes=2, size=64, processes=2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(list(folder.glob("class*/*.jpg"))) == 4


def test_jpeg_folders_cost_is_logged_with_its_provenance(tmp_path, capsys):
    """`jpeg_folder.py --cost N --log FILE`: a loader worker's CPU milliseconds per image (decode,
    and each crop path's worker, the default 2 x 224 + 8 x 96 crops) as a stamped JSON line."""
    log = tmp_path / "cost.jsonl"
    flags = ["--cache", str(tmp_path), "--images", "6", "--classes", "2", "--size", "64"]
    gpu_check.jpeg_folder.main([*flags, "--cost", "3", "--log", str(log)])
    line = json.loads(log.read_text())
    cost = line["one_thread_cost"]
    assert cost["images"] == 3 and 0 < cost["decode_ms"] < cost["pil_multicrop_ms"]
    # --batched_crops' worker decodes too, then draws; its crops are cut on the device
    assert cost["batched_crops_worker_ms"] > cost["decode_ms"] and line["images"] == 6
    assert cost["batched_crops_device_half_on_this_cpu_ms"] > 0
    assert line["command"].endswith("--cost 3 --log " + str(log)) and line["utc"] and line["commit"]
    with pytest.raises(SystemExit, match="^error: --log records the cost: give --cost N too$"):
        gpu_check.jpeg_folder.main([*flags, "--log", str(log)])


def test_cpu_form_every_part_passes_with_one_sync_per_step(tmp_path):
    """The reduced form of the GPU check, as CI runs it. Every part passes; each method's training
    step reads the GPU once (`common.average_step_stats`), so a method that gains a sync fails here
    (gpu_check marks it FAILED, naming the line); the resumed run ends where the uninterrupted one
    did, bit for bit on a CPU; two processes log the loss of one (the mean over the processes) and
    end at its weights; every training part's figures are in summary.jsonl, as its line shows
    them; the JPEG parts read their files through a loader worker."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "extras/perf/gpu_check.py", "--device", "cpu",
                             "--out", str(out), "--jpeg_cache", str(tmp_path / "jpeg")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    table = result.stdout.split("\n\npart ")[1].splitlines()[1:]
    rows = {line.split()[0]: line for line in table
            if line.strip() and not re.match(r"\d+ of \d+ parts passed", line)}
    assert all(" ok " in row for row in rows.values())
    assert {"dino_jpeg", "dino_jpeg_batched"} <= set(rows)
    lines = (out / "summary.jsonl").read_text().splitlines()
    summary = {line["part"]: line for line in map(json.loads, lines)}
    assert set(summary) == set(rows) and all(line["ok"] for line in summary.values())
    trained = [*gpu_check.ARCH, "glsd_batched", "dino_jpeg", "dino_jpeg_batched"]
    assert {name for name, line in summary.items() if line["figures"]} == set(trained)
    for name in trained:                          # the line's figures, recorded and consistent
        f = summary[name]["figures"]
        assert all(math.isfinite(v) and v >= 0 for v in f.values()), f
        args = json.loads((out / name / "args.json").read_text())
        assert f["images"] == f["steps"] * args["batch_size_per_gpu"] and f["steps"] >= 2
        assert f["images_per_s"] * f["wall_s"] == pytest.approx(f["images"])
        assert f["mean_wait_s"] * f["steps"] == pytest.approx(f["wait_share"] * f["wall_s"])
        assert 0 <= f["wait_share"] < 1 and f["median_wait_s"] <= f["median_step_s"]
        wait = f"data wait mean {1e3 * f['mean_wait_s']:.0f} ms ({f['wait_share']:.0%} of the time"
        assert wait in rows[name]
        assert f"epoch {f['images_per_s']:.0f} img/s (waits included" in rows[name]
    for name in ("dino_jpeg", "dino_jpeg_batched"):   # the files, through a loader worker
        args = json.loads((out / name / "args.json").read_text())
        assert (args["dataset"], args["num_workers"]) == ("folder", 1)
        assert Path(args["data_path"]).parent == tmp_path / "jpeg"
    assert re.search(r"\(\d\.\d\dx the PIL crops' epoch images/s\)", rows["dino_jpeg_batched"])
    for method, allowed in gpu_check.SYNCS_PER_STEP.items():
        assert allowed == 1
        assert re.search(r"syncs/step (\d+)", rows[method]).group(1) == "1", rows[method]
    assert "relative difference 0.0e+00" in rows["dino_resumed"]
    for method in ("dino", "esvit", "glsd", "selfpatch"):
        row = rows[f"{method}_two_processes"]
        one, two = re.search(r"loss (\S+) \(one\) / (\S+) \(two\)", row).groups()
        assert abs(float(one) / float(two) - 1) < 1e-5
    assert re.search(r"grad scaler scale \d+", rows["dino_fp16"])
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith(f"{len(rows)} of {len(rows)} parts passed")


def test_a_sigterm_to_the_check_ends_the_part_it_runs(tmp_path):
    """The parts run in their own process groups (a timeout ends a whole part): a SIGTERM to
    gpu_check alone (kill, `timeout`) must end them too, not leave a training running, orphaned, on
    the GPU."""
    out = tmp_path / "out"
    check = subprocess.Popen([sys.executable, "extras/perf/gpu_check.py", "--device", "cpu",
                              "--out", str(out), "--parts", "dino"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    for _ in range(1200):
        if (out / "dino.rank0.log").exists() or check.poll() is not None:
            break
        time.sleep(0.05)
    check.send_signal(signal.SIGTERM)
    _, err = check.communicate(timeout=60)

    def part_processes():       # forked from the check: the same command line, naming --out
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                found += [proc.name] * (str(out) in (proc / "cmdline").read_text())
            except OSError:
                pass
        return found
    time.sleep(0.5)
    assert part_processes() == [] and check.returncode != 0
    assert err.strip().splitlines()[-1].startswith(
        "gpu_check stopped (Ctrl-C or SIGTERM): the part running was ended")
