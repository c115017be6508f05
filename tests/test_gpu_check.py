"""extras/perf/gpu_check.py, the first GPU run in one command. Its CPU form runs here (every part, tiny models,
gloo; about a minute on a busy 2-core CPU); its GPU form's commands are parsed by the scripts' own
parsers; its sync counter counts what would make the host wait for a GPU, and every training step
keeps to the one host sync per step that docs/FIRST_GPU_RUN.md states."""
import importlib
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "extras" / "perf"))
import gpu_check  # noqa: E402


def test_gpu_form_commands_parse_with_the_scripts_own_parsers_at_paper_size(tmp_path):
    for gpus in (1, 2, 8):
        parts = gpu_check.plan("gpu", gpus, tmp_path)
        gpu_check.check_commands(parts)             # a flag a script refuses stops here, in one line
        assert ("dino_two_processes" in {p.name for p in parts}) == (gpus >= 2)
    parts = {p.name: p for p in gpu_check.plan("gpu", 2, tmp_path)}
    for method, arch, batch in (("dino", "vit_small", 64), ("esvit", "swin_tiny", 32), ("glsd", "swin_tiny", 32),
                                ("selfpatch", "vit_small", 64), ("drloc", "swin_tiny", 128)):
        args = importlib.import_module(method).get_args_parser().parse_args(parts[method].argv)
        assert (args.arch, args.batch_size_per_gpu, args.precision, args.device, args.synthetic_image_size) == \
            (arch, batch, "auto", "auto", 256)
        assert (args.epochs, args.max_steps_per_epoch, args.synthetic_images) == (2, 25, 25 * batch)
        if method != "drloc":                       # the papers' crops and heads: the scripts' defaults
            assert (args.global_crop_size, args.local_crop_size, args.local_crops_number, args.out_dim,
                    args.head_hidden_dim, args.patch_size) == (224, 96, 8, 65536, 2048, 16)
        assert parts[method].sync_window == (5, 10)
    assert parts["dino_preempted"].preempt_at == 10 and parts["dino_two_processes"].nproc == 2
    assert parts["dino_two_processes"].env == {"NVIDIA_TF32_OVERRIDE": "0"}
    wrong = parts["dino"]
    wrong.argv = [*wrong.argv, "--no_such_flag"]
    with pytest.raises(SystemExit, match="^error: part dino: dino.py unrecognized arguments: --no_such_flag"):
        gpu_check.check_commands([wrong])


def test_sync_counter_counts_what_would_wait_for_a_gpu():
    x = torch.arange(6.0)
    original = torch.Tensor.tolist
    with gpu_check.SyncCounter() as counter:
        x.sum().item(), bool(x.sum() > 0), float(x[0]), x.tolist(), x[x > 2], x.nonzero()     # 6 reads
        torch.tensor([1.0], device="cpu"), x.to("cpu"), x.cpu()                            # 3 blocking copies
        x.to("cpu", non_blocking=True), x.to(torch.float64), x + 1, torch.zeros(2, device="cpu")  # none
        x[torch.tensor([0, 1])], x.float().mean()                                          # none
    assert counter.count == 9, counter.sites
    assert len(counter.sites) == 2 and {site.split(":")[0] for site in counter.sites} == {"tests/test_gpu_check.py"}
    assert torch.Tensor.tolist is original



def test_cuda_count_takes_only_cudas_sync_warnings_and_names_their_lines(monkeypatch):
    """On a GPU the counter also counts CUDA's own warnings (`set_sync_debug_mode(1)`). Faked here: turning
    the mode on makes torch warn once that it is a prototype, which the first GPU run (H200) took for a
    sync; only 'called a synchronizing CUDA operation' counts, named by the line that made the call."""
    def set_mode(mode):
        if mode:
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    shown = warnings.showwarning

    def synchronising_call():
        warnings.warn(gpu_check.CUDA_SYNC)
    with pytest.warns(UserWarning, match="prototype"), gpu_check.SyncCounter() as counter:   # shown, not counted
        synchronising_call(), synchronising_call()
        with pytest.warns(UserWarning, match="another warning"):         # other warnings pass through
            warnings.warn("another warning")
    line = synchronising_call.__code__.co_firstlineno + 1
    assert counter.cuda == 2 and counter.cuda_sites == {f"tests/test_gpu_check.py:{line}": 2}
    assert warnings.showwarning is shown

def test_cpu_form_every_part_passes_with_one_sync_per_step(tmp_path):
    """The reduced form of the GPU check, as CI runs it. Every part passes; each method's training step
    reads the GPU once (`common.average_step_stats`), so a method that gains a sync fails here (gpu_check marks it
    FAILED, naming the line); the resumed run ends where the uninterrupted one did, bit for bit on a CPU;
    two processes log the loss of one (the mean over the processes) and end at its weights."""
    result = subprocess.run([sys.executable, "extras/perf/gpu_check.py", "--device", "cpu", "--out", str(tmp_path / "out")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    table = result.stdout.split("\n\npart ")[1].splitlines()[1:]
    rows = {line.split()[0]: line for line in table if line.strip() and not line.startswith(("19 of", "\n"))}
    assert all(" ok " in row for row in rows.values())
    for method, allowed in gpu_check.SYNCS_PER_STEP.items():
        assert allowed == 1 and re.search(r"syncs/step (\d+)", rows[method]).group(1) == "1", rows[method]
    assert "relative difference 0.0e+00" in rows["dino_resumed"]
    for method in ("dino", "esvit", "glsd", "selfpatch"):
        one, two = re.search(r"loss (\S+) \(one\) / (\S+) \(two\)", rows[f"{method}_two_processes"]).groups()
        assert abs(float(one) / float(two) - 1) < 1e-5
    assert re.search(r"grad scaler scale \d+", rows["dino_fp16"])
    assert result.stdout.rstrip().splitlines()[-1].startswith(f"{len(rows)} of {len(rows)} parts passed")


def test_a_sigterm_to_the_check_ends_the_part_it_runs(tmp_path):
    """The parts run in their own process groups (a timeout ends a whole part): a SIGTERM to gpu_check alone
    (kill, `timeout`) must end them too, not leave a training running, orphaned, on the GPU."""
    out = tmp_path / "out"
    check = subprocess.Popen([sys.executable, "extras/perf/gpu_check.py", "--device", "cpu", "--out", str(out), "--parts",
                              "dino"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
    assert err.strip().splitlines()[-1].startswith("gpu_check stopped (Ctrl-C or SIGTERM): the part running was ended")
