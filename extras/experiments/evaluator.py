"""The evaluations of one row of extras/experiments/compare.py (20-NN, linear probe, token
correspondence, teacher collapse), each a logged command with its wall and CPU seconds and the
figures' lines of its output. Not a script."""
import json
import re
import resource
import sys
import time
from pathlib import Path

import provenance
import results

EVAL = "--resize 32 --crop 32 --num_workers 1"
# The authors' 100 epochs, on features extracted once (no augmentation: the epochs cost seconds, not
# a pass of the backbone each). The lr was chosen on the val phase (docs/COMPARISON.md, "Columns").
LINEAR = "--precomputed_features true --epochs 100 --val_freq 100 --lr 1.0 --batch_size_per_gpu 256"
CORRESPONDENCE_IMAGES = 500
# the lines of an evaluation's output that hold a logged figure (kept in the JSON line as
# raw_output)
RAW_FIGURES = r"NN classifier result|top-10 accuracy|per-image entropy|K = \d+ \(ln K"


def children_cpu_seconds():
    # finished children and their waited-for children
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Evaluator:
    """Runs the commands of one row, records them, and adds up their wall and CPU seconds by kind
    (CPU seconds count the cores a command kept busy, its loader workers included: on a shared
    machine they say what a row costs better than wall time)."""

    def __init__(self, data, out, seed):
        self.data = data
        self.out = Path(out)
        self.seed = seed
        self.commands = []
        self.wall_seconds = {}
        self.cpu_seconds = {}
        self.raw_output = {}

    def call(self, args, log_name):
        kind = log_name.split(".")[0].split("_")[0]
        self.commands.append(" ".join(["python", *args]))
        start = time.time()
        cpu = children_cpu_seconds()
        output = provenance.run([sys.executable, *args], self.out / log_name)
        for total, value in ((self.wall_seconds, time.time() - start),
                             (self.cpu_seconds, children_cpu_seconds() - cpu)):
            total[kind] = round(total.get(kind, 0.0) + value, 1)
        figures = [line for line in output.splitlines() if re.search(RAW_FIGURES, line)]
        if figures:
            self.raw_output[log_name.removesuffix(".txt")] = figures
        return output

    def knn(self, weights, random_init=False, name="knn"):
        """{k: top-1} at DINO's four k (10, 20, 100, 200): no comparison rests on one k."""
        baseline = ["--random_init", "--seed", str(self.seed)] if random_init else []
        ks = [str(k) for k in results.KNN_KS]
        return results.knn_top1_by_k(self.call(["eval_knn.py", *self.data, *EVAL.split(),
                                                "--nb_knn", *ks, "--pretrained_weights",
                                                str(weights), *baseline], f"{name}.txt"))

    def linear(self, weights, random_init=False):
        out = self.out / "linear"
        baseline = ["--random_init"] if random_init else []
        self.call(["eval_linear.py", *self.data, *EVAL.split(), *LINEAR.split(),
                   "--seed", str(self.seed), "--pretrained_weights", str(weights), *baseline,
                   "--output_dir", str(out)], "linear.txt")
        # the last epoch's top-1, not eval_linear's best over the validated epochs (it also
        # validates epoch 0): nothing is chosen on the evaluation split
        last = (out / "log.txt").read_text().splitlines()[-1]
        self.raw_output["linear"] = [last]
        return json.loads(last)["val_top1"]

    def correspondence(self, weights, random_init=False, protocols=("esvit", "overlap"),
                       name="correspondence"):
        baseline = ["--random_init"] if random_init else []
        return results.parse_correspondence(self.call(
            ["extras/tools/eval_correspondence.py", *self.data, "--crop_size", "32", "--max_images",
             str(CORRESPONDENCE_IMAGES), "--num_workers", "0", "--seed", str(self.seed),
             "--protocols", *protocols,
             "--pretrained_weights", str(weights), *baseline], f"{name}.txt"))

    def collapse(self, weights):
        return results.parse_collapse(self.call(["extras/tools/teacher_outputs.py", *self.data,
                                                 *EVAL.split(), "--max_images", "2000",
                                                 "--pretrained_weights", str(weights)],
                                                "teacher_outputs.txt"))
