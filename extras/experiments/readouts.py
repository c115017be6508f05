"""The evaluations of one row of the drivers (20-NN, linear probe, token correspondence, teacher
collapse: each a logged command with its wall and CPU seconds and the figures' lines of its
output), what the drivers read from the output of eval_knn.py, extras/tools/eval_correspondence.py
and extras/tools/teacher_outputs.py, the k-NN on raw pixels, and the Fashion-MNIST ImageFolder of
compare.py's `fashion_mnist_8k`. Not a script."""
import json
import math
import re
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import eval_knn  # noqa: E402
import provenance  # noqa: E402

# ------------------------------------------------------------------------------------------------
# What the drivers read: the figures in the evaluations' output, the k-NN on raw pixels, the
# Fashion-MNIST ImageFolder of compare.py's `fashion_mnist_8k`
# ------------------------------------------------------------------------------------------------
def knn_top1(output):
    return knn_top1_by_k(output)["20"]


def knn_top1_by_k(output):
    """{"10": top-1, "20": ...}: every k of eval_knn.py's output (`--nb_knn 10 20 100 200`)."""
    found = re.findall(r"(\d+)-NN classifier result: top-1 ([0-9.]+)%", output)
    if not any(k == "20" for k, _ in found):
        sys.exit("error: no 20-NN result in eval_knn.py's output")
    return {k: float(value) for k, value in found}


def parse_correspondence(output):
    """{protocol: {top10_accuracy, accuracy, ...}} from extras/tools/eval_correspondence.py's log
    lines."""
    metrics = {}
    for m in re.finditer(r"(\w+): top-10 accuracy ([0-9.]+)%, distance ([0-9.]+) cells \| all "
                         r"tokens: accuracy "
                         r"([0-9.]+)% \(chance ([0-9.]+)%\), distance ([0-9.]+) cells", output):
        metrics[m.group(1)] = dict(zip(["top10_accuracy", "top10_distance", "accuracy",
                                        "chance_accuracy",
                                        "distance"], map(float, m.groups()[1:])))
    if not metrics:
        sys.exit("error: no correspondence metrics in extras/tools/eval_correspondence.py's output")
    return metrics


def parse_collapse(output):
    k = re.search(r"K = (\d+) \(ln K", output)
    h = re.search(r"per-image entropy ([0-9.]+) \| entropy of the mean target ([0-9.]+)", output)
    if not (k and h):
        sys.exit("error: no entropies in extras/tools/teacher_outputs.py's output")
    return {"teacher_entropy": float(h.group(1)), "mean_target_entropy": float(h.group(2)),
            "ln_k": math.log(int(k.group(1)))}


KNN_KS = (10, 20, 100, 200)      # DINO's k of its k-NN evaluation


def pixels_knn_by_k(bank, queries, ks=KNN_KS, resize=32, crop=32):
    """{k: top-1} of the k-NN (T = 0.07, eval_knn.py's vote) on the raw pixels as the networks are
    evaluated on them (eval_knn.py's transform flattened and l2-normalised) at each k of `ks`.
    `bank` and `queries` are labelled datasets of PIL images."""
    transform = common.eval_transform(resize, crop)

    def features(dataset):
        pairs = [dataset[i] for i in range(len(dataset))]
        pixels = torch.stack([transform(image.convert("RGB")).flatten() for image, _ in pairs])
        labels = torch.tensor([label for _, label in pairs])
        return torch.nn.functional.normalize(pixels, dim=1), labels

    (bank_features, bank_labels), (query_features, query_labels) = features(bank), features(queries)
    return {k: eval_knn.knn_classifier(bank_features, bank_labels, query_features, query_labels,
                                       k=k, T=0.07, num_classes=len(bank.classes))[0]
            for k in ks if k <= len(bank_labels)}        # no k past the bank's size


def write_fashion_mnist_8k(data_dir):
    """Fashion-MNIST's 10000 test images as an ImageFolder (extras/experiments/compare.py's
    `fashion_mnist_8k`): the first 8000 in train/, the last 2000 in val/, one PNG each under its
    class name. Kept if it is already complete."""
    root = Path(data_dir) / "fashion_mnist_8k"
    if root.is_dir() and len(list(root.glob("*/*/*.png"))) == 10000:
        return root
    test = common.FashionMNIST(train=False)
    for i in range(len(test)):
        image, label = test[i]
        name = re.sub(r"\W+", "_", f"{label}_{test.classes[label]}")
        folder = root / ("train" if i < 8000 else "val") / name
        folder.mkdir(parents=True, exist_ok=True)
        image.convert("L").save(folder / f"{i:05d}.png")
    return root


# ------------------------------------------------------------------------------------------------
# The evaluations of one row (20-NN, linear probe, token correspondence, teacher collapse), each
# a logged command with its wall and CPU seconds and the figures' lines of its output
# ------------------------------------------------------------------------------------------------
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
        ks = [str(k) for k in KNN_KS]
        return knn_top1_by_k(self.call(["eval_knn.py", *self.data, *EVAL.split(),
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
        return parse_correspondence(self.call(
            ["extras/tools/eval_correspondence.py", *self.data, "--crop_size", "32", "--max_images",
             str(CORRESPONDENCE_IMAGES), "--num_workers", "0", "--seed", str(self.seed),
             "--protocols", *protocols,
             "--pretrained_weights", str(weights), *baseline], f"{name}.txt"))

    def collapse(self, weights):
        return parse_collapse(self.call(["extras/tools/teacher_outputs.py", *self.data,
                                                 *EVAL.split(), "--max_images", "2000",
                                                 "--pretrained_weights", str(weights)],
                                                "teacher_outputs.txt"))
