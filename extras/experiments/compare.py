"""The controlled comparison of docs/COMPARISON.md: every self-supervised method at ONE shared
budget (steps, batch, crops, lr schedule, teacher settings, seeds) on both small backbones, so that
a row's difference from the DINO row of its backbone is what the method adds.

    # choose: the held-out 10000 train images
    python extras/experiments/compare.py --phase val --seeds 0 1
    python extras/experiments/compare.py --phase test --seeds 0 1   # report: once per final setting
    # the same comparison on a second dataset
    python extras/experiments/compare.py --data shapes --phase test --seeds 0 1
    # probe the logged rows' checkpoints; their kept checkpoints' curve
    python extras/experiments/compare.py --phase test --seeds 0 1 --add_linear
    python extras/experiments/compare.py --phase test --seeds 1 --add_curve --curve_every 200
    python extras/experiments/compare.py --table    # refresh docs/COMPARISON.md from the log

Rows, baselines, the shared budget (SHARED, STEPS_PER_EPOCH steps an epoch), read-outs and the
datasets (DATA; fashion_mnist_8k is written from Fashion-MNIST's test images, which no run trains
on): docs/COMPARISON.md, "Protocol". One JSON line per (data, row, variant, phase, seed) goes to
--log with every command that produced it, the figures' lines of their raw output, and
provenance.stamp. A relaunch goes on where it stopped: a logged row is skipped, a row stopped
part-way resumes from its checkpoint (the method script refuses changed flags), logged `resumed`.
"""
import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import provenance  # noqa: E402  (this file's folder is on sys.path when it runs as a script)
import split_ledger  # noqa: E402
import results  # noqa: E402
import compare_tables  # noqa: E402
import appendix  # noqa: E402
from provenance import Evaluator  # noqa: E402
from compare_tables import (BACKBONES, METHOD_FLAGS, RANDOM_ROWS, ROWS,  # noqa: E402,F401
                            comparison_table, log_key, summary_table)

ROOT = results.ROOT
COMPARISON_MD = ROOT / "docs" / "COMPARISON.md"
# the blocks of the comparison outside COMPARISON.md: the README's "Results at a glance", RESULTS.md
SUMMARY_FILES = {ROOT / "README.md": ("summary", "long_glance"),
                 ROOT / "docs" / "RESULTS.md": ("summary",)}
# the detail blocks, out of the reader's path (every generator writes its own there)
APPENDIX_MD = ROOT / "docs" / "APPENDIX.md"
LOG_KEYS = ("data", "row", "variant", "phase", "seed")   # every line of the log has them
TAG = "compare.py"
COMMITTED_LEDGER = split_ledger.LEDGER     # the documents' (a test may point the drivers elsewhere)

STEPS_PER_EPOCH = 50      # at most the 62 steps of an 8000-image epoch at batch 128
# Shared by every row: crops, heads (K = 1024: the region heads of EsViT and GLSD see every token),
# optimisation, teacher. Set explicitly even where a script's default agrees, because the scripts'
# defaults differ (crop scales, teacher temperature warm-up, last-layer normalisation).
SHARED = ("--global_crop_size 32 --local_crop_size 16 --local_crops_number 4 "
          "--global_crops_scale 0.4 1 --local_crops_scale 0.05 0.4 --out_dim 1024 "
          "--head_hidden_dim 512 --head_bottleneck_dim 128 --norm_last_layer false "
          "--batch_size_per_gpu 128 --lr 0.004 --min_lr 1e-6 --weight_decay 0.04 "
          "--weight_decay_end 0.04 --clip_grad 3.0 --freeze_last_layer 0 --momentum_teacher 0.99 "
          "--drop_path_rate 0 --warmup_teacher_temp 0.04 --teacher_temp 0.04 "
          "--warmup_teacher_temp_epochs 0 --batched_crops true --num_workers 0")
# BACKBONES, METHOD_FLAGS (row: backbone, script, the method's own flags), RANDOM_ROWS, ROWS:
# compare_tables.py
DATA = {   # name: (dataset flags, held-out images for the val phase or None)
    "fashion_mnist": ("--dataset fashion_mnist", 10000),
    "shapes": ("--dataset synthetic --synthetic_images 8000 --synthetic_image_size 28", None),
    "fashion_mnist_8k": ("--dataset folder --data_path {data_dir}/fashion_mnist_8k", None),
}
# set by the driver from --data, --phase, --steps, --curve_every, --seeds and --work_dir (an --extra
# that set one would train another split, dataset or budget than its log line names)
DRIVER_FLAGS = {"--dataset", "--data_path", "--holdout", "--epochs", "--max_steps_per_epoch",
                "--saveckp_freq", "--seed", "--output_dir"}


def training_flags(row, steps, curve_every):
    backbone, _, own = METHOD_FLAGS[row]
    epochs = steps // STEPS_PER_EPOCH
    budget = (f"--epochs {epochs} --max_steps_per_epoch {STEPS_PER_EPOCH} "
              f"--warmup_epochs {epochs / 2:g} --saveckp_freq {curve_every // STEPS_PER_EPOCH}")
    return f"{SHARED} {BACKBONES[backbone]} {budget} {own}".split()


def check_budget(steps, curve_every):
    if steps <= 0 or steps % STEPS_PER_EPOCH or curve_every <= 0 or curve_every % STEPS_PER_EPOCH \
            or steps % curve_every:
        sys.exit(f"error: --steps {steps} and --curve_every {curve_every} must be positive "
                 "multiples of "
                 f"{STEPS_PER_EPOCH} (the steps of one epoch), --curve_every dividing --steps")


def data_flags(data, phase, data_dir):
    flags, holdout = DATA[data]
    if phase == "val" and holdout is None:
        sys.exit(f"error: --data {data} runs the test phase only (settings are chosen on "
                 "fashion_mnist's val phase)")
    held_out = ["--holdout", str(holdout)] if phase == "val" else []
    return flags.format(data_dir=data_dir).split() + held_out





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
        with common.open_for_writing(folder / f"{i:05d}.png", "wb") as f:
            image.convert("L").save(f, format="PNG")
    return root


def row_paths(row, args, seed):
    """A row's output folder and the checkpoint it is evaluated on (a random-init row: the network
    of its source row at the first step, start.pth in its own folder)."""
    out = Path(args.work_dir) / args.data / f"{row}_{args.variant}_{args.phase}_seed{seed}"
    return out, out / ("start.pth" if row in RANDOM_ROWS else "checkpoint.pth")


def train_command(row, args, seed):
    """`python SCRIPT FLAGS` of a method row's training (a random-init row: its source row's)."""
    row = RANDOM_ROWS.get(row, row)
    out = row_paths(row, args, seed)[0]
    return ["python", METHOD_FLAGS[row][1], *training_flags(row, args.steps, args.curve_every),
            *data_flags(args.data, args.phase, args.data_dir), *args.extra.split(),
            "--seed", str(seed), "--output_dir", str(out)]


def finished(record, evaluate, started):
    return {**record, "commands": evaluate.commands, "wall_seconds": evaluate.wall_seconds,
            "cpu_seconds": evaluate.cpu_seconds, "raw_output": evaluate.raw_output,
            **provenance.stamp(started)}


def ledger_use(row, args, seed, evaluation="row"):
    """The ledger's guard of this evaluation (split_ledger.ledger_guard): a second test use of the
    same row, seed and budget is refused now without --reason; calling it records the use."""
    command = " ".join(train_command(row, args, seed)) if row != "pixels" else \
        f"python extras/experiments/compare.py --data {args.data} --phase test --rows pixels"
    use = {"driver": TAG, "data": args.data, "row": row, "seed": seed, "budget": args.steps,
           "evaluation": evaluation, "command": command}
    return split_ledger.ledger_guard(args.ledger, use, args.reason, args.phase == "test")


def run_row(row, args, seed):
    """Train (unless a random-init or pixel row) and evaluate one row for one seed: its JSON
    record."""
    started = provenance.start()
    record = {"data": args.data, "row": row, "variant": args.variant, "phase": args.phase,
              "seed": seed, "steps": args.steps}
    use = ledger_use(row, args, seed)

    def before_test():
        if use():
            record["test_use"] = use.id
    data = data_flags(args.data, args.phase, args.data_dir)
    if row == "pixels":   # deterministic: the seed changes nothing
        before_test()
        by_k = pixels_knn(data)
        by_k = {str(k): value for k, value in by_k.items()}
        record.update(knn_top1=by_k["20"], knn_top1_by_k=by_k)
        return {**record, **provenance.stamp(started)}
    out, weights = row_paths(row, args, seed)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "linear").exists():
        sys.exit(f"error: {out} holds an earlier run of this row: move it away, or log a --variant")
    # a row that is not logged but has a checkpoint was stopped: the method script resumes it (and
    # refuses changed flags); its training cost is then that of the last process only, not logged
    resumed = row not in RANDOM_ROWS and (out / "checkpoint.pth").exists()
    evaluate = Evaluator(data, out, seed)
    record["backbone"] = METHOD_FLAGS[RANDOM_ROWS.get(row, row)][0]
    if row in RANDOM_ROWS:
        record["random_init"] = True
        source = " ".join(train_command(row, args, seed))
        record.update(start_of=source, network=provenance.starting_checkpoint(source, weights))
        before_test()
        by_k = evaluate.knn(weights, random_init=True)
        record.update(knn_top1=by_k["20"], knn_top1_by_k=by_k,
                      correspondence=evaluate.correspondence(weights, random_init=True))
        if not args.skip_linear:
            record["linear_top1"] = evaluate.linear(weights, random_init=True)
        return finished(record, evaluate, started)
    train = train_command(row, args, seed)[1:]
    evaluate.call(train, "train_resumed.txt" if resumed else "train.txt")
    provenance.check_trained(train, out)
    record["network"] = provenance.checkpoint_signature(weights)
    if resumed:
        record["resumed"] = True
        for total in (evaluate.wall_seconds, evaluate.cpu_seconds):
            total["train_resumed"] = total.pop("train")
    else:
        record["train_seconds"] = evaluate.wall_seconds["train"]
    # what --precision auto chose
    record["precision"] = json.loads((out / "args.json").read_text())["precision"]
    epochs = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    record["peak_memory_mb"] = round(max(e["peak_memory_mb"] for e in epochs))
    record["epochs"] = [{k: v for k, v in e.items() if isinstance(v, float)} for e in epochs]
    before_test()
    by_k = evaluate.knn(weights)
    record.update(knn_top1=by_k["20"], knn_top1_by_k=by_k,
                  correspondence=evaluate.correspondence(weights), **evaluate.collapse(weights))
    if not args.skip_linear:
        record["linear_top1"] = evaluate.linear(weights)
    if seed in args.curve_seeds:
        record["curve"] = curve_points(evaluate, kept_paths(out, args))
    return finished(record, evaluate, started)


def kept_paths(out, args):
    """{step: the checkpoint a training keeps there}, every --curve_every steps before its last."""
    every = args.curve_every // STEPS_PER_EPOCH
    return {e * STEPS_PER_EPOCH: out / f"checkpoint{e:04d}.pth"
            for e in range(every, args.steps // STEPS_PER_EPOCH, every)}


def curve_points(evaluate, kept):
    """k-NN (20 and the four k) and `overlap` all-token accuracy of each kept checkpoint ({step:
    path})."""
    points = []
    for step, path in kept.items():
        knn = evaluate.knn(path, name=f"curve_knn_{path.stem[10:]}")
        correspondence = evaluate.correspondence(path, protocols=("overlap",),
                                                 name=f"curve_correspondence_{path.stem[10:]}")
        points.append({"step": step, "knn_top1": knn["20"], "knn_top1_by_k": knn,
                       "overlap_accuracy": correspondence["overlap"]["accuracy"]})
    return points


def check_kept(record, kept):
    """Refuse a kept checkpoint that is missing or was not written while the logged training ran
    (between its line's start and its time): a later run's would put another network into the
    line."""
    if not (record.get("started_utc") and record.get("utc")):
        sys.exit(f"error: the line of {record['row']} seed {record['seed']} has no times (logged "
                 "before stamps): which run kept its checkpoints is unknown")
    start, end = (provenance.utc_seconds(record[k]) for k in ("started_utc", "utc"))
    # a resumed run kept some before its last process
    start = 0 if record.get("resumed") else start
    for step, path in kept.items():
        if not path.is_file():
            sys.exit(f"error: {path} is missing: {record['row']} seed {record['seed']} kept no "
                     f"checkpoint at step {step} (a --curve_every other than its training's?)")
        if not start <= path.stat().st_mtime <= end:
            sys.exit(f"error: {path} is not from the logged run of {record['row']} seed "
                     f"{record['seed']} (written outside its time): its curve cannot be added")


def add_evaluation(row, args, seed, kind):
    """The linear probe (kind "linear_top1") or the learning curve ("curve") of a logged row run
    without it, from its kept checkpoints: written into its log line, with the commands and their
    cost."""
    key = (args.data, row, args.variant, args.phase, seed)
    logged = [r for r in compare_tables.current(compare_tables.read_checked(args.log))
              if log_key(r) == key]
    if len(logged) != 1 or kind in logged[0] or (kind == "curve" and row in RANDOM_ROWS):
        return None      # not logged (or twice), already evaluated, or a random init (no curve)
    # the line the tables show: a relogged row's stamped one
    stamped = bool(logged[0].get("utc"))
    out, weights = row_paths(row, args, seed)
    if row in RANDOM_ROWS and not weights.is_file():
        source = logged[0].get("start_of") or " ".join(train_command(row, args, seed))
        provenance.starting_checkpoint(source, weights)
    if not weights.is_file():
        sys.exit(f"error: {row} seed {seed} is logged but its checkpoint {weights} is missing: it "
                 "cannot be evaluated")
    if kind == "linear_top1" and (out / "linear").exists():
        sys.exit(f"error: {out / 'linear'} holds an earlier probe of this row: move it away")
    if kind == "curve":
        check_kept(logged[0], kept_paths(out, args))
    use = ledger_use(row, args, seed, kind)()
    started = provenance.start()
    evaluate = Evaluator(data_flags(args.data, args.phase, args.data_dir), out, seed)
    value = (evaluate.linear(weights, random_init=row in RANDOM_ROWS) if kind == "linear_top1"
             else curve_points(evaluate, kept_paths(out, args)))
    with provenance.locked(args.log):
        lines = Path(args.log).read_text().splitlines()
        for i, line in enumerate(lines):
            r = json.loads(line) if line.strip() else {}
            if log_key(r) == key and bool(r.get("utc")) == stamped:
                r[kind] = value
                r["commands"] = r.get("commands", []) + evaluate.commands
                for total in ("wall_seconds", "cpu_seconds", "raw_output"):
                    r[total] = {**r.get(total, {}), **getattr(evaluate, total)}
                r[f"{kind.split('_')[0]}_provenance"] = provenance.stamp(started)
                lines[i] = json.dumps(r)
        provenance.rewrite_log(args.log, lines)
    if use:
        result = value if kind == "linear_top1" else [point["knn_top1"] for point in value]
        split_ledger.record_test_result(args.ledger, use, result)
    return value


def pixels_knn(data):
    """{k: k-NN top-1} of the l2-normalised raw grey pixels (eval_knn.py's vote) at DINO's four k
    (results.KNN_KS), on the splits of the rows."""
    parser = argparse.ArgumentParser()
    common.add_data_args(parser)
    data_args = parser.parse_args(data)
    return results.pixels_knn_by_k(common.build_dataset(data_args, train=True),
                                   common.build_dataset(data_args, train=False))


# ------------------------------------------------------------------------------------------------
# docs/COMPARISON.md, README.md, docs/RESULTS.md: generated blocks (compare_tables.py)
# ------------------------------------------------------------------------------------------------
def reproducing_commands(records):
    defaults = get_args_parser().parse_args([])
    return appendix.reproducing_commands(records, defaults.curve_every, defaults.curve_seeds)


def findings_runs(records):
    """(data, phase, variant) of every run the documents show, test first, in the log's order."""
    runs = {}
    for r in records:
        if r["row"] in METHOD_FLAGS:
            runs.setdefault((r["data"], r["phase"], r["variant"]), r["steps"])
    return sorted(runs, key=lambda run: (list(DATA).index(run[0]), run[1] != "test", runs[run]))


def generated_blocks(records, ledger=None):
    """{block: markdown} of the documents, from the log's records and the test ledger (its path;
    default: the committed one). A rerun of a setting (DINO's four k) is shown in the appendix."""
    entries = split_ledger.read_ledger(ledger or COMMITTED_LEDGER)
    records = compare_tables.current(records)
    shown, again = compare_tables.split_reruns(records)
    blocks = {f"{data}_{phase}": comparison_table(records, data, phase, entries, shown)
              for data, (_, holdout) in DATA.items()
              for phase in ("test", "val") if phase == "test" or holdout}
    blocks.update(summary=summary_table(shown, entries), costs=appendix.costs_table(records),
                  findings=compare_tables.findings_table(shown, findings_runs(shown)),
                  long_budget=compare_tables.long_budget_table(shown, entries),
                  long_glance=compare_tables.long_glance_table(shown, entries),
                  reruns=comparison_table(records, "fashion_mnist", "test", entries, again),
                  withdrawn=split_ledger.withdrawn_table(entries, {TAG, "quickstart.py"}),
                  knn_k=appendix.knn_k_table(records),
                  knn_k_pixels=appendix.knn_k_pixels_table(records),
                  test_uses=split_ledger.ledger_table(entries, {TAG, "quickstart.py"}, "steps"))
    commands = reproducing_commands(records)
    blocks["commands"] = (("```bash\n" + "\n".join(commands) + "\n```") if commands
                          else "No run is logged yet.")
    return blocks


def get_args_parser():
    p = argparse.ArgumentParser("compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="fashion_mnist", choices=list(DATA),
                   help="the dataset of the comparison")
    p.add_argument("--phase", default="val", choices=["val", "test"],
                   help="val: train without the held-out images and evaluate on them; test: the "
                        "reported numbers")
    p.add_argument("--rows", nargs="+", default=None, choices=ROWS,
                   help="rows to run, in this order (default: all, unless --table alone; a "
                        "random-init row evaluates its source row's network at the first step, "
                        "without training it)")
    p.add_argument("--seeds", nargs="+", type=common.COUNT, default=[0, 1])
    p.add_argument("--steps", default=400, type=int,
                   help="training steps of every row (a multiple of 50)")
    p.add_argument("--curve_every", default=100, type=int,
                   help="keep and evaluate a checkpoint every N steps")
    p.add_argument("--curve_seeds", nargs="*", type=common.COUNT, default=[0],
                   help="seeds whose kept checkpoints are evaluated")
    p.add_argument("--skip_linear", action="store_true",
                   help="no linear probe (its column shows —): about a fifth of a row's CPU time")
    p.add_argument("--add_linear", action="store_true",
                   help="train nothing: probe the kept checkpoints of the logged --rows and "
                        "--seeds that have no linear top-1 yet (run with "
                        "--skip_linear), and write it into their log lines")
    p.add_argument("--add_curve", action="store_true",
                   help="train nothing: evaluate the checkpoints kept every "
                        "--curve_every steps by the logged --rows and "
                        "--seeds that have no learning curve yet (seeds not in "
                        "--curve_seeds), into their log lines")
    return split_ledger.add_driver_args(p, "compare", "compare_32px.jsonl", data_dir=True)


def main():
    args = get_args_parser().parse_args()
    if args.extra and args.variant == "recipe":
        sys.exit("error: name a variant (--variant NAME) for --extra flags")
    # the line would name a data split or budget not trained
    if results.flags_set_by(args.extra, DRIVER_FLAGS):
        sys.exit(f"error: --extra cannot set {', '.join(sorted(DRIVER_FLAGS))}: --data, --phase, "
                 "--steps, --curve_every, --seeds and --work_dir do")
    check_budget(args.steps, args.curve_every)
    provenance.run_from_root(args, "work_dir", "data_dir", "log", "ledger")
    rows = args.rows if args.rows is not None else [] if args.table else ROWS
    if rows or args.add_linear or args.add_curve:
        provenance.check_log_writable(args.log)
        if args.phase == "test":       # before any training: else a result without a ledger line
            provenance.check_log_writable(args.ledger, what="--ledger")
    if args.data == "fashion_mnist_8k" and rows:
        write_fashion_mnist_8k(args.data_dir)
    logged = provenance.read_log(args.log, LOG_KEYS) if rows and Path(args.log).exists() else []
    for kind, flag in (("linear_top1", "--add_linear"), ("curve", "--add_curve")):
        if getattr(args, flag[2:]):
            if not Path(args.log).is_file():
                sys.exit(f"error: {flag} evaluates the rows logged in --log {args.log}, which does "
                         "not exist")
            for row in [r for r in (args.rows or ROWS) if r != "pixels"]:
                for seed in args.seeds:
                    value = add_evaluation(row, args, seed, kind)
                    if value is not None:
                        print(f"{args.data} {row} {args.variant} {args.phase} seed {seed}: {kind} "
                              f"{value}", flush=True)
            rows = []
    for row in rows:
        # the pixel row has no seed: logged once per (data, phase), by the run whose --seeds hold 0,
        # and once more where no line of it holds the four k (a test use: --reason)
        pixels_logged = any((r["data"], r["phase"], r["row"]) == (args.data, args.phase, "pixels")
                            and "knn_top1_by_k" in r for r in logged)
        pixel_seeds = [0] if 0 in args.seeds and not pixels_logged else []
        for seed in args.seeds if row != "pixels" else pixel_seeds:
            key = (args.data, row, args.variant, args.phase, seed)
            lines = [r for r in logged
                     if log_key(r) == key and (row != "pixels" or "knn_top1_by_k" in r)]
            if lines:
                print(f"{args.data} {row} {args.variant} {args.phase} seed {seed}: logged already",
                      flush=True)
                continue
            record = run_row(row, args, seed)
            if args.extra:
                record["extra"] = args.extra
            split_ledger.log_result(args, record, record["knn_top1"])
            print(f"{args.data} {row} {args.variant} {args.phase} seed {seed}: 20-NN "
                  f"{record['knn_top1']:.2f}%"
                  + (f", linear {record['linear_top1']:.2f}%" if "linear_top1" in record else "")
                  + (f", {record['train_seconds'] / 60:.1f} min training"
                     if "train_seconds" in record else ""),
                  flush=True)
    if args.table:      # every block is made before any file is written
        blocks = generated_blocks(compare_tables.read_checked(args.log), args.ledger)
        results.write_documents({COMPARISON_MD: blocks, APPENDIX_MD: blocks,
                                 **{path: {n: blocks[n] for n in names}
                                    for path, names in SUMMARY_FILES.items()}}, TAG)


if __name__ == "__main__":
    main()
