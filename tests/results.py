"""The README's Fashion-MNIST results table: small CPU presets of every method, k-NN (or, for DRLoc,
supervised) top-1 on the real test split, over several seeds. Not collected by pytest.

    python tests/results.py --runs dino esvit --seeds 0 1      # train + evaluate, append to the log
    python tests/results.py --runs pixels --seeds 0            # the k-NN on raw pixels, for scale
    python tests/results.py --table                             # the markdown table of everything logged

Each (run, seed) trains in its own output directory under --work_dir, is evaluated with
eval_knn.py (k = 20, T = 0.07, all 60000 train images as the bank, the 10000 test images), and
appends one JSON line (top-1, wall time of training, peak memory, the exact commands) to --log.
Presets are sized for one core of a 2-core CPU: the ViT runs see 800 steps of 32 images, the Swin
runs 250 (a Swin step at 64 px costs about five ViT-pico/8 steps), DRLoc 5 epochs of 10000 images.
GLSD's Similarity and Vanilla settings are the EsViT runs with and without the region loss: they train
bit-identically, so `--table` shows those runs for them unless they were run themselves.
Nothing is tuned on the test split: the hyperparameters are the CPU recipe of the README's
"What a few CPU minutes show" section, fixed before any of these runs.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SSL = ("--dataset fashion_mnist --global_crop_size 64 --local_crop_size 32 --local_crops_number 4 "
       "--batch_size_per_gpu 32 --head_hidden_dim 256 --head_bottleneck_dim 64 --out_dim 1024 "
       "--drop_path_rate 0 --warmup_epochs 1 --num_workers 1 --saveckp_freq 0")
VIT = "--arch vit_pico --patch_size 8 --lr 0.001 --epochs 10 --max_steps_per_epoch 80"
SWIN = ("--arch swin_pico --lr 0.002 --momentum_teacher 0.99 --teacher_temp 0.02 --warmup_teacher_temp 0.02 "
        "--epochs 5 --max_steps_per_epoch 50")
DRLOC = ("--dataset fashion_mnist --train_subset 10000 --arch swin_pico --input_size 56 --batch_size_per_gpu 64 "
         "--epochs 5 --warmup_epochs 1 --lr 5e-3 --lambda_warmup_epochs 1 --num_workers 1")

# name: (script or None for a random initialisation, flags, evaluation image size)
RUNS = {
    "pixels": (None, None, None),   # no network: the same k-NN on the raw 28x28 pixels
    "random_vit": (None, "--arch vit_pico --patch_size 8", 64),
    "random_swin": (None, "--arch swin_pico", 64),
    "dino": ("dino.py", f"{SSL} {VIT}", 64),
    "selfpatch": ("selfpatch.py", f"{SSL} {VIT} --patch_out_dim 256", 64),
    "esvit": ("esvit.py", f"{SSL} {SWIN}", 64),
    "esvit_view": ("esvit.py", f"{SSL} {SWIN} --use_region_loss false", 64),
    "glsd_none": ("glsd.py", f"{SSL} {SWIN} --local_matching none", 64),
    "glsd_similarity": ("glsd.py", f"{SSL} {SWIN} --local_matching similarity", 64),
    "glsd_geometric": ("glsd.py", f"{SSL} {SWIN} --local_matching geometric", 64),
    "drloc": ("drloc.py", DRLOC, None),
    "drloc_base": ("drloc.py", f"{DRLOC} --lambda_drloc 0", None),
}


def run(cmd, log_path):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "w") as log:
        result = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed; see {log_path}")
    return Path(log_path).read_text()


def knn_top1(output):
    match = re.search(r"20-NN classifier result: top-1 ([0-9.]+)%", output)
    if not match:
        sys.exit("error: no 20-NN result in eval_knn.py's output")
    return float(match.group(1))


def pixels_top1():
    """20-NN (T = 0.07, eval_knn.py's vote) on the l2-normalised raw pixels of Fashion-MNIST."""
    sys.path.insert(0, str(ROOT))
    import common
    import eval_knn
    train, test = common.FashionMNIST(train=True), common.FashionMNIST(train=False)
    features = [torch.nn.functional.normalize(torch.tensor(d.images.reshape(len(d), -1), dtype=torch.float32), dim=1)
                for d in (train, test)]
    labels = [torch.as_tensor(d.targets) for d in (train, test)]
    return eval_knn.knn_classifier(features[0], labels[0], features[1], labels[1], k=20, T=0.07, num_classes=10)[0]


def train_and_evaluate(name, seed, work_dir):
    script, flags, size = RUNS[name]
    if name == "pixels":  # deterministic: the seed changes nothing
        return {"run": name, "seed": seed, "train_seconds": 0.0, "peak_memory_mb": None, "top1": pixels_top1(),
                "eval_command": f"python tests/results.py --runs pixels --seeds {seed}"}
    out = Path(work_dir) / f"{name}_seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    record = {"run": name, "seed": seed}
    evaluation = [sys.executable, "eval_knn.py", "--dataset", "fashion_mnist", "--nb_knn", "20", "--num_workers", "1"]
    if script is None:  # random initialisation: the seed picks the initial weights
        evaluation += ["--random_init", *flags.split(), "--seed", str(seed), "--resize", str(size), "--crop", str(size)]
        record.update(train_seconds=0.0, peak_memory_mb=None)
    else:
        train = [sys.executable, script, *flags.split(), "--seed", str(seed), "--output_dir", str(out)]
        start = time.time()
        run(train, out / "train.txt")
        record["train_seconds"] = round(time.time() - start, 1)
        epochs = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
        record["peak_memory_mb"] = round(max(e["peak_memory_mb"] for e in epochs))
        record["train_command"] = " ".join(["python", *train[1:]])
        if script == "drloc.py":  # supervised: its own validation top-1 after the last epoch
            record["top1"] = epochs[-1]["val_acc1"]
        else:
            evaluation += ["--pretrained_weights", str(out / "checkpoint.pth"), "--resize", str(size), "--crop", str(size)]
    if "top1" not in record:
        record["top1"] = knn_top1(run(evaluation, out / "eval.txt"))
        record["eval_command"] = " ".join(["python", *evaluation[1:]])
    return record


# GLSD's Similarity and Vanilla settings train bit-identically to EsViT with and without its region
# loss (same seed, same flags; tests/test_glsd.py checks it), so the table reuses those runs for them.
SAME_TRAINING = {"glsd_none": "esvit_view", "glsd_similarity": "esvit"}


def table(records):
    rows = ["| run | seeds | top-1 (%) mean ± spread | train time (min) | peak memory (MB) |", "|---|---|---|---|---|"]
    for name in RUNS:
        rs = [r for r in records if r["run"] == name]
        if not rs and name in SAME_TRAINING:
            rs = [r for r in records if r["run"] == SAME_TRAINING[name]]
            name = f"{name} (= {SAME_TRAINING[name]})"
        if not rs:
            continue
        top1 = [r["top1"] for r in rs]
        spread = (max(top1) - min(top1)) / 2
        minutes = statistics.mean(r["train_seconds"] for r in rs) / 60
        memory = [r["peak_memory_mb"] for r in rs if r["peak_memory_mb"]]
        rows.append(f"| {name} | {len(rs)} | {statistics.mean(top1):.1f} ± {spread:.1f} | {minutes:.1f} | "
                    f"{max(memory) if memory else '—'} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser("results.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=[], choices=list(RUNS), help="presets to train and evaluate")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--work_dir", default="runs/results", help="output directories of the runs")
    p.add_argument("--log", default=str(ROOT / "tests" / "results_fashion_mnist.jsonl"),
                   help="one JSON line per (run, seed) is appended here")
    p.add_argument("--table", action="store_true", help="print the markdown table of the log")
    args = p.parse_args()
    for name in args.runs:
        for seed in args.seeds:
            record = train_and_evaluate(name, seed, args.work_dir)
            with open(args.log, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{name} seed {seed}: top-1 {record['top1']:.1f}%, {record['train_seconds'] / 60:.1f} min", flush=True)
    if args.table:
        print(table([json.loads(line) for line in Path(args.log).read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main()
