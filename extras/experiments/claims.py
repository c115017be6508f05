"""What the documents may claim from two seeds, and DRLoc's paired comparisons (used by
extras/experiments/results.py; not a script).

The rule, stated once (docs/RESULTS.md and docs/COMPARISON.md, "What counts as a finding"): with two
seeds, a difference is a finding only where its mean exceeds both the seeds' spread (half their
range) and the binomial standard error of one evaluation (`finding`, which every generated verdict
comes from); "the same sign on both seeds" happens half the time by chance and is not evidence on
its own.
"""

import math
import re
import statistics

# DRLoc in its paper's regime: supervised training from scratch on a small dataset (the first
# 5000 train images; --phase val: validated on the first 5000 of the held-out 10000), both
# backbones at 28 px with a 4x4 final grid (swin_pico3: 14 -> 7 -> 4; vit_pico/4: 7x7 pooled to
# 4x4), lambda = 0.5 against 0, DRLOC_EPOCHS epochs (`--variant short`: a third of them)
DRLOC_EPOCHS = 6
DRLOC_ARCHS = {
    "swin": "--arch swin_pico3 --fit_window true",
    "vit": "--arch vit_pico --patch_size 4",
}


def paired_difference(
    records, phase, run="drloc", baseline="drloc_base", variant="recipe", numbers=False
):
    """DRLoc's comparison: top-1 of `run` minus `baseline` seed by seed (a seed fixes the backbone's
    initialisation and the batch order of both runs), as `told` states it with the binomial error
    of one evaluation on 10000 images (numbers: the differences instead, in seed order)."""
    top1 = {}
    for r in records:
        if (
            r.get("phase") == phase
            and r.get("variant", "recipe") == variant
            and r["run"] in (run, baseline)
        ):
            top1.setdefault(r["run"], {})[r["seed"]] = r["top1"]
    seeds = sorted(set(top1.get(run, {})) & set(top1.get(baseline, {})))
    if len(seeds) < 2:
        return None
    diffs = [top1[run][s] - top1[baseline][s] for s in seeds]
    if numbers:
        return diffs
    values = [top1[name][s] for name in (run, baseline) for s in seeds]
    return f"{run} - {baseline}, paired by seed: {told(diffs, binomial_error(values, 10000))}"


def drloc_setting(record):
    """(data, epochs) of a DRLoc run: its command's last --dataset and --epochs (an --extra's),
    else the recipe's."""
    command = record.get("train_command", "")
    data, epochs = (
        re.findall(r"--dataset (\w+)", command) or ["fashion_mnist"],
        re.findall(r"--epochs (\d+)", command),
    )
    default = {"recipe": DRLOC_EPOCHS, "short": DRLOC_EPOCHS // 3}.get(
        record.get("variant", "recipe")
    )
    return {"synthetic": "shapes"}.get(data[-1], data[-1]), int(epochs[-1]) if epochs else default


DRLOC_EVAL_IMAGES = 5000  # DRLoc's small-data runs are evaluated on 5000 images (either split)


def binomial_error(top1s, images):
    """The binomial standard error, in points, of one evaluation of `images` images at the largest
    error of the accuracies `top1s` (%) (the noise of one run's figure, before any seed)."""
    worst = min(max(max(top1s, key=lambda t: t * (100 - t)) / 100, 0.0), 1.0)
    return 100 * math.sqrt(worst * (1 - worst) / images)


def finding(diffs, error):
    """The documents' one rule for two seeds, the only source of a comparative verdict: "finding"
    where the mean difference exceeds both the seeds' spread (half their range) and one
    evaluation's binomial error, "no finding" where it exceeds neither, "undecided" where it
    exceeds one of the two (or one seed only): more seeds would decide."""
    if len(diffs) < 2:
        return "undecided"
    mean, spread = abs(statistics.mean(diffs)), (max(diffs) - min(diffs)) / 2
    if mean > spread and mean > error:
        return "finding"
    return "no finding" if mean <= spread and mean <= error else "undecided"


def told(diffs, error):
    """A difference as the documents state it, generated: mean, each seed, the binomial error and
    the verdict of `finding`, e.g. "+0.82 (+1.53, +0.10; SE 0.49): finding"."""
    seeds = ", ".join(f"{d:+.2f}" for d in diffs)
    return f"{statistics.mean(diffs):+.2f} ({seeds}; SE {error:.2f}): {finding(diffs, error)}"


def drloc_regime(records):
    """Whether the DRLoc paper's direction holds on the small-dataset runs (a larger gain of
    λ = 0.5 over λ = 0 for the Swin than for the ViT, and for shorter training), per dataset and
    length on validation, by `finding`'s rule; then the test's."""
    def setting(r):
        """(arch, data, epochs) of a drloc5k run (λ = 0.5 or 0); None for another run."""
        arch = r["run"].removeprefix("drloc5k_").removesuffix("_base")
        return (arch, *drloc_setting(r)) if r["run"].startswith("drloc5k_") else None

    def paired(phase):
        """{(arch, data, epochs): differences by seed}: per setting, by data, architecture,
        longest training first, the recipe's variant before the others, the first with two."""
        variants = {(s[0], r.get("variant", "recipe")): s for r in records
                    if r["phase"] == phase and (s := setting(r)) and s[0] in DRLOC_ARCHS}
        found = {}
        def order(item):
            (arch, variant), (_, data, epochs) = item
            return data, list(DRLOC_ARCHS).index(arch), -epochs, variant != "recipe"
        for (arch, variant), key in sorted(variants.items(), key=order):
            diffs = paired_difference(records, phase, f"drloc5k_{arch}", f"drloc5k_{arch}_base",
                                      variant, True)
            if diffs:
                found.setdefault(key, diffs)
        return found

    def error(phase, *keys):
        """The binomial error of one evaluation at the worst top-1 of the runs of `keys`."""
        top1s = [r["top1"] for r in records if r["phase"] == phase and setting(r) in keys]
        return binomial_error(top1s or [50.0], DRLOC_EVAL_IMAGES)

    def compare(a, b, what):
        gap, se = [x - y for x, y in zip(found[a], found[b])], error("val", a, b)
        said = "holds here" if statistics.mean(gap) > 0 else "the opposite holds here"
        said = said if finding(gap, se) == "finding" else "not decided here"
        return f"- {what}: {said} (gap {told(gap, se)})"

    def on(data):
        return "" if data == "fashion_mnist" else f", {data}"

    found, tested = paired("val"), paired("test")
    if not found:
        logged = sorted({f"`{r['run']}` ({r.get('variant', 'recipe')}, seed {r['seed']})"
                         for r in records
                         if r["run"].startswith("drloc5k_") and r["phase"] == "val"})
        return ("No paired difference yet (each needs the recipe's λ and λ = 0 with 2 seeds); "
                f"logged so far: {', '.join(logged) or 'nothing'}.")
    lines = ["DRLoc, the recipe's λ minus λ = 0, validation top-1 (points), paired by seed, "
             "first 5000 train images:"]
    lines += [f"- `{arch}`, {n} epochs{on(data)}: {told(diffs, error('val', (arch, data, n)))}"
              for (arch, data, n), diffs in found.items()]
    lines += [compare(("swin", d, n), ("vit", d, n),
                      f"a larger gain for the Swin than for the ViT ({n} epochs{on(d)})")
              for d, n in dict.fromkeys((d, n) for _, d, n in found)
              if {("swin", d, n), ("vit", d, n)} <= found.keys()]
    for arch, data in dict.fromkeys((a, d) for a, d, _ in found):   # each length against the next
        mine = sorted(n for a, d, n in found if (a, d) == (arch, data))
        lines += [compare((arch, data, a), (arch, data, b), "a larger gain for shorter training "
                          f"(`{arch}`, {a} against {b} epochs{on(data)})")
                  for a, b in zip(mine, mine[1:])]
    lines += [f"- the test split (its first 5000 images), `{arch}`, {n} epochs{on(data)}: "
              f"{told(diffs, error('test', (arch, data, n)))}"
              for (arch, data, n), diffs in tested.items()]
    lines.append("- rule (claims.finding): a finding where the mean exceeds both the seeds' spread "
                 "(half their range) and one evaluation's binomial error (SE) on "
                 f"{DRLOC_EVAL_IMAGES} images, no finding where it exceeds neither, undecided "
                 "otherwise")
    return "\n".join(lines)
