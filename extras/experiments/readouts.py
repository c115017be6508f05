"""What the results' drivers read: the figures in the output of eval_knn.py,
extras/tools/eval_correspondence.py and extras/tools/teacher_outputs.py, the k-NN on raw pixels,
and the Fashion-MNIST ImageFolder of extras/experiments/compare.py's `fashion_mnist_8k`. Not a
script."""
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import eval_knn  # noqa: E402


def knn_top1(output):
    match = re.search(r"20-NN classifier result: top-1 ([0-9.]+)%", output)
    if not match:
        sys.exit("error: no 20-NN result in eval_knn.py's output")
    return float(match.group(1))


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


def pixels_knn_top1(bank, queries, resize=32, crop=32):
    """20-NN (T = 0.07, eval_knn.py's vote) on the raw pixels as the networks are evaluated on them:
    eval_knn.py's transform (bicubic resize, centre crop, normalisation) flattened and
    l2-normalised. `bank` and `queries` are labelled datasets of PIL images."""
    return pixels_knn_by_k(bank, queries, (20,), resize, crop)[20]


def pixels_knn_by_k(bank, queries, ks=KNN_KS, resize=32, crop=32):
    """{k: top-1} of pixels_knn_top1's k-NN at each k of `ks`, the features made once."""
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
