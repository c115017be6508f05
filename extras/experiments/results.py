"""Fashion-MNIST results of docs/RESULTS.md: small-image CPU recipes of every method at the images'
own scale (32 px crops of the 28 px images), over several seeds. Not collected by pytest.

    # choose: train on 50k, k-NN on the other 10k; report: train on 60k, k-NN on the test split
    python extras/experiments/results.py --runs dino --phase val --seeds 0
    python extras/experiments/results.py --runs dino --phase test --seeds 0 1
    python extras/experiments/results.py --runs pixels    # the k-NN on raw pixels, for scale
    python extras/experiments/results.py --table          # refresh docs/RESULTS.md from the log

Phases, baseline and measure: docs/RESULTS.md, "Protocol". One JSON line per (run, variant, phase,
seed) goes to --log with the exact commands, train time, peak memory and provenance.stamp;
`--variant NAME --extra "FLAGS"` logs a variant of a recipe under its own name. `--table` rewrites
the generated blocks (`<!-- results.py:NAME -->` ... `<!-- /results.py -->`) of docs/RESULTS.md
and docs/APPENDIX.md from the stamped lines, each row's command included (its flags that differ
from the recipe as it stands now, parsed with the script's own parser).
"""
import argparse
import importlib
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import claims  # noqa: E402
import common  # noqa: E402
import eval_knn  # noqa: E402
import provenance  # noqa: E402
import split_ledger  # noqa: E402
from claims import DRLOC_ARCHS, DRLOC_EPOCHS, drloc_regime, paired_difference  # noqa: E402,F401
from provenance import KNN_KS, knn_top1  # noqa: E402

RESULTS_MD = ROOT / "docs" / "RESULTS.md"
APPENDIX_MD = ROOT / "docs" / "APPENDIX.md"       # the detail blocks, out of the reader's path
COMMITTED_LEDGER = split_ledger.LEDGER     # the documents' (a test may point the drivers elsewhere)


# Shared by the self-supervised recipes: 2 global crops of 32 px and 4 local crops of 16 px, a head
# sized for a 64-dim backbone, lr warm-up and frozen last layer counted in fractions of the run.
SSL = ("--dataset fashion_mnist --global_crop_size 32 --local_crop_size 16 --local_crops_number 4 "
       "--out_dim 4096 --head_hidden_dim 512 --head_bottleneck_dim 128 --norm_last_layer false "
       "--batch_size_per_gpu 128 --weight_decay 0.04 --weight_decay_end 0.04 --freeze_last_layer 0 "
       "--momentum_teacher 0.99 --drop_path_rate 0 --num_workers 1 --saveckp_freq 0")
VIT = "--arch vit_pico --patch_size 4 --lr 0.004 --epochs 1 --warmup_epochs 0.5"
# K = 1024 for the Swin recipes: their region heads see every token (48 per image), and with K =
# 4096 the region softmaxes of a batch take 100 MB per pass, most of a step's time on a CPU.
SWIN = ("--arch swin_pico3 --fit_window true --out_dim 1024 --lr 0.004 --epochs 1 "
        "--warmup_epochs 0.5")

# DRLoc is supervised: vit_pico/2 at the images' 28 px gives a 14x14 grid, pooled to the paper's 7x7
# (as DRLoc's ViT-B at 224 px); 5 epochs of 10000 train images; its number is its own top-1.
DRLOC = ("--dataset fashion_mnist --train_subset 10000 --arch vit_pico --patch_size 2 "
         "--input_size 28 --batch_size_per_gpu 64 --epochs 5 --warmup_epochs 1 --lr 5e-3 "
         "--lambda_warmup_epochs 1 --num_workers 1")

# DRLoc in its paper's regime (claims.py: DRLOC_EPOCHS, DRLOC_ARCHS)
DRLOC_SMALL = ("--dataset fashion_mnist --train_subset 5000 --val_subset 5000 --input_size 28 "
               f"--batch_size_per_gpu 64 --lr 5e-3 --epochs {DRLOC_EPOCHS} --warmup_epochs 1 "
               "--lambda_warmup_epochs 1 --num_workers 0 --saveckp_freq 0")

SELFPATCH_EPOCHS1 = (f"{SSL} {VIT} --out_dim 1024 --patch_out_dim 1024 --teacher_temp 0.01 "
                     "--warmup_teacher_temp 0.01")

# name: (script, flags)
RUNS = {
    "pixels": (None, None),   # no network: the same k-NN on the raw pixels at the same 32 px
    "dino": ("dino.py", f"{SSL} {VIT}"),
    # SelfPatch: three epochs at teacher temperature 0.02 with DINO's crop scales, on the one-epoch
    # base its variants were searched on (below); --saveckp_freq 1 keeps each epoch's checkpoint
    "selfpatch": ("selfpatch.py", f"{SELFPATCH_EPOCHS1} --teacher_temp 0.02 "
                                  "--warmup_teacher_temp 0.02 --epochs 3 --warmup_epochs 1 "
                                  "--global_crops_scale 0.4 1 --local_crops_scale 0.05 0.4 "
                                  "--saveckp_freq 1"),
    # The one-epoch base: K = K_p = 1024 (one patch head output per token) and teacher temperature
    # 0.01, not 4096 and the paper's 0.04 (variants `tt0.04`, `tt0.02`, `k1024_tt0.02`)
    "selfpatch_epochs1": ("selfpatch.py", SELFPATCH_EPOCHS1),
    # EsViT: two epochs (one gained less on validation), warm-up still half the run (later flags
    # win)
    "esvit": ("esvit.py", f"{SSL} {SWIN} --epochs 2 --warmup_epochs 1"),
    "glsd": ("glsd.py", f"{SSL} {SWIN} --local_matching geometric"),
    "drloc": ("drloc.py", DRLOC),
    "drloc_base": ("drloc.py", f"{DRLOC} --lambda_drloc 0"),
    **{f"drloc5k_{arch}{suffix}": ("drloc.py", f"{DRLOC_SMALL} {flags}{extra}") for arch,
       flags in DRLOC_ARCHS.items()
       for suffix, extra in (("", ""), ("_base", " --lambda_drloc 0"))},
}
HOLDOUT = 10000


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


def pixels_top1(phase):
    """The raw-pixel 20-NN of Fashion-MNIST: val, the last HOLDOUT train images against the others;
    test, the test split against the train split."""
    data = argparse.Namespace(dataset="fashion_mnist", data_path=None,
                              holdout=HOLDOUT if phase == "val" else 0)
    return pixels_knn_by_k(common.build_dataset(data, train=True),
                           common.build_dataset(data, train=False), (20,))[20]


def train_and_evaluate(name, variant, extra, phase, seed, work_dir, ledger=None, reason=""):
    """One run's JSON record, stamped (provenance.stamp: UTC time, commit, machine). On the test
    phase its ledger line is appended first (`ledger`: the ledger's path)."""
    started = provenance.start()
    # recorded as the first test image is about to be read (DRLoc: before training, whose every
    # epoch evaluates; the others: after it)
    use = ledger_use(name, extra, phase, seed, ledger or split_ledger.LEDGER, reason)
    record = train_and_evaluate_unstamped(name, variant, extra, phase, seed, work_dir, use)
    return {**record, **({"test_use": use.id} if use.id else {}), **provenance.stamp(started)}


def ledger_use(name, extra, phase, seed, ledger, reason):
    """The ledger's guard of a run (split_ledger.ledger_guard); its budget: the epochs its training
    command ends with (later flags win)."""
    script, flags = RUNS[name]
    command = ("python extras/experiments/results.py --runs pixels --phase test" if script is None
               else " ".join(["python", script, *flags.split(), *extra.split(), "--seed",
                              str(seed)]))
    use = {"driver": "results.py", "data": "fashion_mnist", "row": name, "seed": seed,
           "budget": budget_of({"train_command": command}), "evaluation": "row",
           "command": command}
    return split_ledger.ledger_guard(ledger, use, reason, phase == "test")


def train_and_evaluate_unstamped(name, variant, extra, phase, seed, work_dir,
                                 before_test=lambda: None):
    """One run's record; `before_test` is called as the evaluation split is about to be read."""
    record = {"run": name, "variant": variant, "phase": phase, "seed": seed}
    if name == "pixels":  # deterministic: the seed changes nothing
        before_test()
        return {**record, "top1": pixels_top1(phase), "train_seconds": 0.0}
    script, flags = RUNS[name]
    split = ["--holdout", str(HOLDOUT)] if phase == "val" else []
    out = Path(work_dir) / f"{name}_{variant}_{phase}_seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    train = [sys.executable, script, *flags.split(), *extra.split(), *split, "--seed", str(seed),
             "--output_dir", str(out)]
    # a stopped run goes on: its time would be its last process's only
    resumed = (out / "checkpoint.pth").exists()
    if script == "drloc.py":        # its epochs end with an evaluation
        before_test()
    start = time.time()
    provenance.run(train, out / "train.txt")
    provenance.check_trained(train, out)
    record.update({"resumed": True} if resumed
                  else {"train_seconds": round(time.time() - start, 1)})
    epochs = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    record["peak_memory_mb"] = round(max(e["peak_memory_mb"] for e in epochs))
    record["last_epoch"] = {k: v for k, v in epochs[-1].items() if isinstance(v, float)}
    record["train_command"] = " ".join(["python", *train[1:]])
    # supervised: its own top-1 on the evaluation split after the last epoch
    if script == "drloc.py":
        record["top1"] = epochs[-1]["val_acc1"]
        record["raw_output"] = {"log": (out / "log.txt").read_text().splitlines()[-1]}
        return record
    evaluation = [sys.executable, "eval_knn.py", "--dataset", "fashion_mnist", "--nb_knn", "20",
                  "--num_workers", "1",
                  "--resize", "32", "--crop", "32", "--pretrained_weights",
                  str(out / "checkpoint.pth"), *split]
    before_test()
    outputs = {"eval": provenance.run(evaluation, out / "eval.txt")}
    record["top1"] = knn_top1(outputs["eval"])
    record["eval_command"] = " ".join(["python", *evaluation[1:]])
    baseline = [*evaluation, "--random_init", "--seed", str(seed)]
    outputs["random_init"] = provenance.run(baseline, out / "eval_random.txt")
    record["random_init_top1"] = knn_top1(outputs["random_init"])
    record["random_init_command"] = " ".join(["python", *baseline[1:]])
    record["raw_output"] = {k: [line for line in v.splitlines() if "NN classifier result" in line]
                            for k, v in outputs.items()}
    return record


def cell(values, digits=1):
    """Mean ± half the range of the values that are not None; a lone value as it is; — when
    none."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def budget_of(record):
    """The epochs a run's training command ends with (later flags win); None for the pixels."""
    found = re.findall(r"--epochs[ =](\S+)", record.get("train_command", ""))
    return int(float(found[-1])) if found else None


def test_uses(rs, entries):
    """The ledger's count beside the figures: which test use of its run and budget each line is."""
    return split_ledger.use_notes(
        rs, entries, lambda r: ("results.py", "fashion_mnist", r["run"], r["seed"], budget_of(r),
                                "row"), lambda r: r["top1"])


def table(records, phase, entries=None):
    """One line per (run, variant) of a phase: mean ± half-range over the seeds; the gain is each
    seed's top-1 minus its own checkpoint's with --random_init, per seed in seed order, with the
    rule's verdict (claims.finding); a resumed run's train time "—"; on test, which use of the
    test split each seed's figure is."""
    uses = entries is not None and phase == "test"
    rows = ["| run | variant | seeds | 20-NN top-1 (%) | random init (%) | gain (points; per seed) "
            "| train time (min) | "
            "peak memory (MB) | logged (UTC) |" + (" test use (seed: use of the run's uses) |"
                                                  if uses else ""), "|---" * (9 + uses) + "|"]
    groups = {}
    for r in records:
        if r.get("phase") == phase:
            groups.setdefault((r["run"], r.get("variant", "recipe")), []).append(r)
    validated = {(r["run"], r.get("variant", "recipe")) for r in records if r["phase"] == "val"}
    for (name, variant), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])          # per-seed figures in seed order
        top1 = [r["top1"] for r in rs]
        if phase == "test" and name != "pixels" and (name, variant) not in validated:
            variant = f"{variant} (test only)"
        logged = " / ".join(sorted({r["utc"][:10] for r in rs}))
        note = f" {test_uses(rs, entries)} |" if uses else ""
        if name == "pixels":
            pixels = f"| raw pixels | — | — | {top1[0]:.1f} |"
            rows.append(pixels + " — |" * 4 + f" {logged} |" + note)
            continue
        timed = all("train_seconds" in r for r in rs)                # a resumed run logs no time
        minutes = f"{statistics.mean(r['train_seconds'] for r in rs) / 60:.1f}" if timed else "—"
        if "random_init_top1" not in rs[0]:   # DRLoc: supervised top-1, mean ± standard deviation
            spread = statistics.stdev(top1) if len(top1) > 1 else 0.0
            rows.append(f"| {name} (supervised top-1, ± std) | {variant} | {len(rs)} | "
                        f"{statistics.mean(top1):.1f} ± {spread:.1f} | — | — | {minutes} | "
                        f"{max(r['peak_memory_mb'] for r in rs)} | {logged} |" + note)
            continue
        random_init = [r["random_init_top1"] for r in rs]
        gains = [a - b for a, b in zip(top1, random_init)]
        per_seed = f" ({', '.join(f'{g:+.1f}' for g in gains)})" if len(gains) > 1 else ""
        verdict = claims.finding(gains, claims.binomial_error(top1 + random_init, HOLDOUT))
        rows.append(f"| {name} | {variant} | {len(rs)} | {cell(top1)} | {cell(random_init)} | "
                    f"{cell(gains)}{per_seed}: {verdict} | {minutes} | "
                    f"{max(r['peak_memory_mb'] for r in rs)} | {logged} |" + note)
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# docs/RESULTS.md: generated blocks
# ------------------------------------------------------------------------------------------------
# set by train_and_evaluate, not by a recipe
RUN_PLACE_FLAGS = {"--holdout", "--seed", "--output_dir"}


def flags_set_by(extra, flags):
    """Which of `flags` an --extra sets, abbreviated ones too (argparse reads --hold as
    --holdout)."""
    words = [word.split("=")[0] for word in extra.split()
             if word.startswith("--") and len(word.split("=")[0]) > 2]
    return sorted({flag for flag in flags for word in words if flag.startswith(word)})


def logged_flags(record):
    """The training flags of a logged run, without those that train_and_evaluate adds itself."""
    words = record["train_command"].split()[2:]          # drop "python script.py"
    return [w for i, w in enumerate(words)
            if w not in RUN_PLACE_FLAGS and (i == 0 or words[i - 1] not in RUN_PLACE_FLAGS)]


def as_flag_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(as_flag_value(v) for v in value)
    return str(value)


def extra_flags(record):
    """The --extra that, added to the recipe as it stands in RUNS, trains what `record` trained:
    every argument whose parsed value differs, in the parser's order."""
    script, flags = RUNS[record["run"]]
    parser = importlib.import_module(script[:-3]).get_args_parser()
    recipe = vars(parser.parse_args(flags.split()))
    logged = vars(parser.parse_args(logged_flags(record)))
    extra = []
    for action in parser._actions:
        if action.option_strings and recipe.get(action.dest) != logged.get(action.dest):
            if logged[action.dest] is None:
                sys.exit(f"error: cannot express --{action.dest} None as a flag ({record['run']} "
                         f"{record['variant']})")
            extra.append(f"{action.option_strings[0]} {as_flag_value(logged[action.dest])}")
    return " ".join(extra)


def reproducing_commands(records):
    """One `python extras/experiments/results.py ...` line per (run, variant, phase, extra), seeds
    together, in the order the log first holds them."""
    groups = {}
    for r in records:
        extra = "" if r["run"] == "pixels" else extra_flags(r)
        groups.setdefault((r["run"], r.get("variant", "recipe"), r["phase"], extra),
                          []).append(r["seed"])
    return [f"python extras/experiments/results.py --runs {name} --phase {phase}"
            + ("" if name == "pixels" else f" --seeds {' '.join(str(s) for s in sorted(seeds))}")
            + variant_flags(variant, extra) for (name, variant, phase, extra),
            seeds in groups.items()]


def variant_flags(variant, extra):
    """The command-line tail naming a logged variant and its extra flags ("" for the recipe)."""
    tail = f" --variant {variant}" if variant != "recipe" or extra else ""
    return tail + (f' --extra "{extra}"' if extra else "")


LOG_KEYS = ("run", "phase", "seed")      # every line of the log has them


def network_run(r):
    return RUNS.get(r.get("run"), (None,))[0] is not None


# every field of a log line that the tables and the commands read: (key, kind, for which lines,
# optional); provenance.check_fields refuses a line without them in one line
FIELDS = [("run", set(RUNS), provenance.always, False),
          ("phase", {"val", "test"}, provenance.always, False),
          ("seed", "integer", provenance.always, False),
          ("top1", "number", provenance.always, False),
          ("variant", "text", provenance.always, True), ("utc", "text", provenance.always, True),
          ("train_command", "text", network_run, False),
          ("peak_memory_mb", "number", network_run, False),
          ("random_init_top1", "number", network_run, True),
          ("train_seconds", "number", provenance.always, True)]


def read_checked(path):
    """The log's records, each holding every field the tables read (else one line and exit 1)."""
    return provenance.check_fields(provenance.read_log(path, LOG_KEYS), path, FIELDS)


def log_key(record):
    return record["run"], record.get("variant", "recipe"), record["phase"], record["seed"]


def generated_blocks(records, ledger=None):
    """{block name: markdown} of docs/RESULTS.md and docs/APPENDIX.md from the stamped lines (the
    lines logged before stamps are in FROZEN blocks only) and the test ledger (its path; default:
    the committed one)."""
    entries = split_ledger.read_ledger(ledger or COMMITTED_LEDGER)
    uses = split_ledger.ledger_table(entries, {"results.py"}, "epochs")
    blocks = {}
    records = [r for r in records if r.get("utc")]
    for phase in ("test", "val"):
        text = table(records, phase, entries)
        comparison = paired_difference(records, phase)
        if comparison:
            text += f"\n\nDRLoc: {comparison}."
        blocks[phase] = text
    blocks["commands"] = "```bash\n" + "\n".join(reproducing_commands(records)) + "\n```"
    blocks["drloc_regime"] = drloc_regime(records)
    blocks["test_uses"] = uses
    blocks["withdrawn"] = split_ledger.withdrawn_table(entries, {"results.py"})
    return blocks


def write_documents(documents, tag="results.py"):
    """Refresh the `tag` blocks of each document ({path: its blocks}), every block made before any
    file is written, and say which changed."""
    texts = {path: path.read_text() for path in documents}
    refreshed = {path: refresh(texts[path], blocks, tag) for path, blocks in documents.items()}
    for path, text in refreshed.items():
        with common.open_for_writing(path) as f:  # never through a symbolic link
            f.write(text)
        print(f"{path.relative_to(ROOT)}: "
              f"{'refreshed' if text != texts[path] else 'already up to date'}")


# blocks of fixed history, kept as written: the lines logged before stamps existed, beside their
# stamped reruns (`relogged`) or listed (`unstamped`); every line logged since is stamped
FROZEN = {"relogged", "unstamped"}


def refresh(markdown, blocks, tag="results.py"):
    """`markdown` with the body of every `<!-- TAG:NAME -->` ... `<!-- /TAG -->` block replaced by
    blocks[NAME] (TAG: the script that generates the blocks), FROZEN blocks as they are."""
    def replace(match):
        name = match.group(1)
        if name in FROZEN:
            return match.group(0)
        if name not in blocks:
            sys.exit(f"error: the markdown has a block {name!r} that {tag} does not generate")
        return f"<!-- {tag}:{name} -->\n{blocks[name]}\n<!-- /{tag} -->"
    quoted = re.escape(tag)
    return re.sub(rf"<!-- {quoted}:(\w+) -->\n.*?<!-- /{quoted} -->", replace, markdown, flags=re.S)


def get_args_parser():
    p = argparse.ArgumentParser("results.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=[], choices=list(RUNS),
                   help="recipes to train and evaluate")
    p.add_argument("--phase", default="test", choices=["val", "test"],
                   help="val: train on 50k, evaluate on the held-out 10k train images; test: the "
                        "reported numbers")
    p.add_argument("--seeds", nargs="+", type=common.COUNT, default=[0, 1])
    return split_ledger.add_driver_args(p, "results", "results_32px.jsonl")


def main():
    args = get_args_parser().parse_args()
    provenance.run_from_root(args, "work_dir", "log", "ledger")
    if args.extra and args.variant == "recipe":
        sys.exit("error: name a variant (--variant NAME) for --extra flags")
    if flags_set_by(args.extra, RUN_PLACE_FLAGS):        # e.g. a test line trained with --holdout
        sys.exit(f"error: --extra cannot set {', '.join(sorted(RUN_PLACE_FLAGS))}: --phase, "
                 "--seeds and --work_dir do")
    if args.runs:
        provenance.check_log_writable(args.log)
        if args.phase == "test":
            provenance.check_log_writable(args.ledger, what="--ledger")
    logged = {}                 # key: whether one of its lines is stamped
    for r in provenance.read_log(args.log,
                                 LOG_KEYS) if args.runs and Path(args.log).is_file() else []:
        logged[log_key(r)] = logged.get(log_key(r), False) or bool(r.get("utc"))
    for name in args.runs:
        for seed in args.seeds if name != "pixels" else [0]:
            key = (name, args.variant, args.phase, seed)
            # a relaunch goes on where it stopped
            if key in logged:
                print(f"{name} {args.variant} {args.phase} seed {seed}: already logged, skipped",
                      flush=True)
                continue
            record = train_and_evaluate(name, args.variant, args.extra, args.phase, seed,
                                        args.work_dir, args.ledger, args.reason)
            split_ledger.log_result(args, record, record["top1"])
            baseline = (f" (random init {record['random_init_top1']:.2f}%)"
                        if "random_init_top1" in record else "")
            took = (f"{record['train_seconds'] / 60:.1f} min" if "train_seconds" in record
                    else "resumed")
            print(f"{name} {args.variant} {args.phase} seed {seed}: top-1 "
                  f"{record['top1']:.2f}%{baseline}, {took}", flush=True)
    if args.table:
        blocks = generated_blocks(read_checked(args.log), args.ledger)
        write_documents({RESULTS_MD: blocks, APPENDIX_MD: blocks})


if __name__ == "__main__":
    main()
