"""The README's quick start, run and logged: DINO on vit_pico (400 steps), then its teacher and the
same network at random initialisation by 20-NN. One JSON line per run in --log
(docs/data/quickstart.jsonl) with its commands, the figures' lines of their raw output, UTC time,
commit and machine (extras/experiments/provenance.py); `--table` writes the generated blocks of
README.md and docs/COMPARISON.md from the log. Not collected by pytest.

    # the README's command, test split; the same 400 steps on 8000 images
    python extras/experiments/quickstart.py --data fashion_mnist
    python extras/experiments/quickstart.py --data fashion_mnist_8k
    # that checkpoint, 8k's bank
    python extras/experiments/quickstart.py --data fashion_mnist --eval_data fashion_mnist_8k
    # a variant
    python extras/experiments/quickstart.py --phase val --variant lr8 --steps 250 \\
        --extra "--lr 0.008"
    python extras/experiments/quickstart.py --table

The training command is the README's, with the data flags of --data (compare.py's datasets) and
--holdout 10000 in the val phase; a second --eval_data evaluates the same checkpoint. Of several
lines with the same (data, trained on, phase, variant), the tables show the last one logged and
list the others under it with both figures.
"""
import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import claims  # noqa: E402
import compare  # noqa: E402
import provenance  # noqa: E402
import split_ledger  # noqa: E402
import results  # noqa: E402

TRAIN = ("--arch vit_pico --patch_size 4 {data} --global_crop_size 32 --local_crop_size 16 "
         "--local_crops_number 4 --out_dim 4096 --head_hidden_dim 512 --head_bottleneck_dim 128 "
         "--norm_last_layer false --batch_size_per_gpu 128 --lr 0.004 --weight_decay 0.04 "
         "--weight_decay_end 0.04 --freeze_last_layer 0 --momentum_teacher 0.99 --drop_path_rate 0 "
         "--epochs {epochs} --max_steps_per_epoch 50 --warmup_epochs {warmup:g} "
         "--batched_crops true --num_workers 0")
EVAL = "--resize 32 --crop 32 --nb_knn 20 --num_workers 1"
TARGETS = {"README.md": ("result",), "docs/APPENDIX.md": ("variants", "datasets")}
COMMITTED_LEDGER = split_ledger.LEDGER     # the documents' (a test may point the drivers elsewhere)
LOG_KEYS = ("data", "phase", "variant", "knn_top1", "random_init_knn_top1")
# every field of a log line that the tables read: (key, kind, for which lines, optional)
ALWAYS = provenance.always
FIELDS = [("data", "text", ALWAYS, False), ("phase", {"val", "test"}, ALWAYS, False),
          ("variant", "text", ALWAYS, False), ("knn_top1", "number", ALWAYS, False),
          ("random_init_knn_top1", "number", ALWAYS, False),
          ("steps", "integer", ALWAYS, False), ("trained_on", "text", ALWAYS, True),
          ("train_seconds", "number", ALWAYS, True), ("extra", "text", ALWAYS, True),
          ("teacher_entropy_last_epoch", "number or null", ALWAYS, True),
          ("ln_k", "number", ALWAYS, True), ("utc", "text", ALWAYS, True),
          ("note", "text", ALWAYS, True)]


def read_checked(path):
    """The log's records, each holding every field the tables read (else one line and exit 1)."""
    return provenance.check_fields(provenance.read_log(path, LOG_KEYS), path, FIELDS)


def knn_line(output):
    line = next((text for text in output.splitlines() if "20-NN classifier result" in text),
                None)
    if line is None:
        sys.exit("error: no 20-NN result in eval_knn.py's output")
    return line


def run(args):
    started = provenance.start()
    data = compare.data_flags(args.data, args.phase, args.data_dir)
    eval_data = compare.data_flags(args.eval_data or args.data, args.phase, args.data_dir)
    name = f"{args.variant}_{args.data}_{args.phase}_{args.steps}"
    out = Path(args.work_dir) / name
    if (out / "checkpoint.pth").exists() and not args.eval_data:   # a training that did not run
        raise SystemExit(f"error: {out} already holds a trained run; train again with another "
                         "--work_dir or --variant, or evaluate it with --eval_data")
    out.mkdir(parents=True, exist_ok=True)
    epochs = args.steps // 50
    train = ["dino.py", *TRAIN.format(data=" ".join(data), epochs=epochs,
                                      warmup=epochs / 2).split(),
             *args.extra.split(), "--output_dir", str(out)]
    weights = ["--pretrained_weights", str(out / "checkpoint.pth")]
    evaluation = ["eval_knn.py", *weights, *eval_data, *EVAL.split()]
    baseline = ["eval_knn.py", *weights, "--random_init", *eval_data, *EVAL.split()]
    use = {"driver": "quickstart.py", "data": args.eval_data or args.data,
           "row": f"dino trained on {args.data}", "seed": 0, "budget": args.steps,
           "evaluation": "row", "command": " ".join(["python", *train])}
    # refused before training; recorded as the split is about to be read
    use = split_ledger.ledger_guard(args.ledger, use, args.reason, args.phase == "test")
    start = time.time()
    provenance.run([sys.executable, *train], out / "train.txt")
    provenance.check_trained(train, out)
    train_seconds = round(time.time() - start, 1)
    use()
    raw = {}
    for key, command in (("knn", evaluation), ("random_init", baseline)):
        raw[key] = knn_line(provenance.run([sys.executable, *command],
                                           out / f"eval_{key}_{args.eval_data or args.data}.txt"))
    epochs_log = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    top1 = {k: float(re.search(r"top-1 ([0-9.]+)%", v).group(1)) for k, v in raw.items()}
    return {"data": args.eval_data or args.data, "trained_on": args.data, "phase": args.phase,
            "variant": args.variant, "steps": args.steps, "extra": args.extra,
            "knn_top1": top1["knn"],
            "random_init_knn_top1": top1["random_init"], "train_seconds": train_seconds,
            "teacher_entropy_last_epoch": epochs_log[-1].get("teacher_entropy"),
            "ln_k": math.log(json.loads((out / "args.json").read_text())["out_dim"]),
            "precision": json.loads((out / "args.json").read_text()).get("precision"),
            "commands": [" ".join(["python", *c]) for c in (train, evaluation, baseline)],
            "raw_output": raw,
            **({"test_use": use.id} if use.id else {}),
            **provenance.stamp(started)}


def key(r):
    return r["data"], r.get("trained_on", r["data"]), r["phase"], r["variant"]


def latest(records):
    """The last line logged per (data, trained on, phase, variant), in the order the log first holds
    them."""
    chosen = {}
    for r in records:
        chosen[key(r)] = r
    return list(chosen.values())


def gain(r):
    return f"{r['knn_top1'] - r['random_init_knn_top1']:+.2f}"


def superseded_notes(records, phase, name):
    """One line per `phase` line that a later one of the same key replaced: its figures then and
    now."""
    shown = {key(r): r for r in latest(records)}
    notes = []
    for r in records:
        now = shown[key(r)]
        if r["phase"] == phase and r is not now:
            change = ((now["knn_top1"] - now["random_init_knn_top1"])
                      - (r["knn_top1"] - r["random_init_knn_top1"]))
            notes.append(f"\nSuperseded: {name(r)}, {r['knn_top1']:.2f} against "
                         f"{r['random_init_knn_top1']:.2f} ({provenance.when(r)}): "
                         f"{r.get('note') or 'a later line has the same key'}; the line shown: "
                         f"{now['knn_top1']:.2f} against {now['random_init_knn_top1']:.2f}, gain "
                         f"now minus then {change:+.2f}")
    return notes


def variants_table(records):
    lines = ["| variant | steps | flags added | 20-NN top-1 (%) | random init (%) | gain | h / ln "
             "K (last epoch) | logged (UTC) |", "|---|---|---|---|---|---|---|---|"]
    for r in latest(records):
        if r["phase"] == "val":
            entropy = (f"{r['teacher_entropy_last_epoch'] / r['ln_k']:.2f}" if "ln_k" in r and
                       r.get("teacher_entropy_last_epoch") is not None else "—")
            lines.append(f"| {r['variant']} | {r['steps']} | `{r.get('extra') or '—'}` | "
                         f"{r['knn_top1']:.2f} | {r['random_init_knn_top1']:.2f} | {gain(r)} | "
                         f"{entropy} | {provenance.when(r)} |")
    return "\n".join(lines + superseded_notes(records, "val", lambda r: f"variant {r['variant']}"))


def datasets_table(records, entries):
    """The test-phase lines, and under the table the lines that a later one superseded."""
    lines = ["| data (k-NN bank and queries) | trained on | variant | 20-NN top-1 (%) | random "
             "init (%) | gain | "
             "raw output logged | logged (UTC) | test use |", "|---" * 9 + "|"]
    for r in latest(records):
        if r["phase"] == "test":
            lines.append(f"| {r['data']} | {r.get('trained_on', r['data'])} | {r['variant']} | "
                         f"{r['knn_top1']:.2f} | {r['random_init_knn_top1']:.2f} | {gain(r)} | "
                         f"{'yes' if 'raw_output' in r else 'no'} | {provenance.when(r)} | "
                         f"{use_of(r, entries).replace('test ', '')} |")

    def name(r):
        return f"{r['data']} trained on {r.get('trained_on', r['data'])}"
    return "\n".join(lines + superseded_notes(records, "test", name))


def result_line(records, entries):
    r = next((r for r in reversed(records) if (r["data"], r.get("trained_on", r["data"]),
                                               r["phase"], r["variant"])
              == ("fashion_mnist", "fashion_mnist", "test", "quickstart")), None)
    if r is None:
        return "No run of the quick start is logged yet."
    machine = r.get("machine")         # lines logged before stamps: a description, no time
    minutes = f"{r['train_seconds'] / 60:.1f} min" if "train_seconds" in r else "a time not logged"
    where = (f"{machine['cpu']}, {machine['cores']} cores, {machine['threads']} thread(s), load "
             "average "
             f"{machine['load_average_start'][0]:g} at the start and "
             f"{machine['load_average_end'][0]:g} at the end, "
             f"{r.get('precision')}, {r['utc']}" if isinstance(machine, dict) else
             f"{machine or 'machine not logged'}; no timestamp")
    error = claims.binomial_error([r["knn_top1"], r["random_init_knn_top1"]], 10000)
    told = claims.told([r["knn_top1"] - r["random_init_knn_top1"]], error)
    return (f"20-NN top-1 {r['knn_top1']:.2f}% ({use_of(r, entries)}) against "
            f"{r['random_init_knn_top1']:.2f}% at random initialisation, one seed: {told}; "
            f"{minutes} of training ({where}).")


def use_of(r, entries):
    """Which test use of the quick start (its data and the data trained on, every budget: the
    quick start's steps changed) the line is."""
    row = f"dino trained on {r.get('trained_on', r['data'])}"
    key = ("quickstart.py", r["data"], row, 0, r["steps"], "row")
    uses = sorted((e for e in entries if e["kind"] == "use" and e["driver"] == "quickstart.py"
                   and (e["data"], e["row"]) == (r["data"], row)), key=split_ledger.when_used)
    found = split_ledger.use_of(entries, key, r, r["knn_top1"])
    number = [e["id"] for e in uses].index(found) + 1 if found else "?"
    return f"test use {number} of {len(uses)}" if uses else "no test use in the ledger"


def generated_blocks(records, ledger=None):
    entries = split_ledger.read_ledger(ledger or COMMITTED_LEDGER)
    return {"result": result_line(records, entries), "variants": variants_table(records),
            "datasets": datasets_table(records, entries)}


def get_args_parser():
    p = argparse.ArgumentParser("quickstart.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="fashion_mnist", choices=list(compare.DATA),
                   help="the data trained on")
    p.add_argument("--eval_data", default=None, choices=list(compare.DATA),
                   help="the data of the k-NN (default --data)")
    p.add_argument("--phase", default="test", choices=["val", "test"])
    p.add_argument("--steps", default=400, type=int, help="training steps (a multiple of 50)")
    return split_ledger.add_driver_args(p, "quickstart_log", "quickstart.jsonl", "quickstart",
                                        data_dir=True)


def main():
    args = get_args_parser().parse_args()
    provenance.run_from_root(args, "work_dir", "data_dir", "log", "ledger")
    if args.steps <= 0 or args.steps % 50:
        sys.exit(f"error: --steps {args.steps} must be a positive multiple of 50")
    # as compare.py: its line names them
    if driver_flags := results.flags_set_by(args.extra, compare.DRIVER_FLAGS):
        sys.exit(f"error: --extra cannot set {', '.join(driver_flags)}: "
                 f"its line would name another split, dataset, budget or seed than it trained (use "
                 "--data, --phase, --steps)")
    if not args.table:
        provenance.check_log_writable(args.log)
        provenance.check_log_writable(args.ledger, what="--ledger")
        if "fashion_mnist_8k" in (args.data, args.eval_data):
            compare.write_fashion_mnist_8k(args.data_dir)
        record = run(args)
        split_ledger.log_result(args, record, record["knn_top1"])
        print(f"{record['data']} (trained on {record['trained_on']}) {args.phase} {args.variant}: "
              f"20-NN {record['knn_top1']:.2f}% against {record['random_init_knn_top1']:.2f}%",
              flush=True)
    else:
        blocks = generated_blocks(read_checked(args.log), args.ledger)
        results.write_documents({ROOT / path: {n: blocks[n] for n in names}
                                 for path, names in TARGETS.items()}, "quickstart.py")


if __name__ == "__main__":
    main()
