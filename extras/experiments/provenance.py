"""Where a logged number comes from, and which network it measured (used by the drivers
compare.py, results.py and quickstart.py, and by extras/perf; not a script): `stamp` (the UTC
times, the commit and uncommitted files at the start, the machine), `run` (a command, its output
kept, a SIGTERM passed on), `Evaluator` (compare.py's read-outs of a row, each with its cost and
raw output), `network_signature` and `starting_checkpoint` (the network a checkpoint or a training
command's first step holds: two rows are paired only if equal), and the logs: `locked`,
`append_line`, `rewrite_log`, `read_log` and `check_fields` (one line and exit 1 for a log that is
missing, not JSON lines, or lacks a field a table reads: no table is written from nothing).
"""
import contextlib
import datetime
import fcntl
import hashlib
import importlib
import io
import json
import math
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import eval_knn  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Command, time, commit, machine
# ------------------------------------------------------------------------------------------------
def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_seconds(stamp):
    """Seconds since the epoch of a logged UTC time (utc_now's format)."""
    moment = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")
    return moment.replace(tzinfo=datetime.timezone.utc).timestamp()


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.rstrip("\n")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def load_average():
    return [round(x, 2) for x in os.getloadavg()]


def run(cmd, log_path):
    """`cmd`'s output, also written to `log_path`; one line and a non-zero exit if it fails. A
    SIGTERM to this driver (kill, timeout, a scheduler's) is passed on: without it the command would
    go on, orphaned, holding its --output_dir. A method script then writes its checkpoint, which the
    same command resumes."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    stopped = []
    with common.open_for_writing(log_path) as log:  # never through a symbolic link
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                 env=env)

        def pass_on(*_):
            stopped.append("SIGTERM")
            child.terminate()
        previous = signal.signal(signal.SIGTERM, pass_on)
        try:
            returncode = child.wait()
        # Ctrl-C reached the command too (the terminal's process group)
        except KeyboardInterrupt:
            stopped.append("Ctrl-C")
            returncode = child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if stopped:
        sys.exit(f"stopped ({stopped[0]}) during {cmd[1] if len(cmd) > 1 else cmd[0]}; see "
                 f"{log_path}; run the same command again to go on")
    if returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed; see {log_path}")
    return Path(log_path).read_text()


def start():
    """What `stamp` needs from the start of a logged piece of work, the commit included: the code
    that runs is the one checked out now, whatever is committed before the work ends."""
    changed = [line[3:] for line in git("status", "--porcelain",
                                        "--untracked-files=no").splitlines()]
    return {"started_utc": utc_now(), "load_average_start": load_average(),
            "commit": git("rev-parse", "HEAD"),
            "uncommitted": changed}


def stamp(started):
    """The provenance of a JSON line written now, for work begun at `started` (`start()`)."""
    import torch
    return {"started_utc": started["started_utc"], "utc": utc_now(), "commit": started["commit"],
            "uncommitted": started["uncommitted"],
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                        # what run() gives each command
                        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
                        "load_average_start": started["load_average_start"],
                        "load_average_end": load_average(),
                        "torch": torch.__version__, "python": platform.python_version()}}


def when(record):
    """A record's UTC time, or a mark that its line has none (lines written before stamps
    existed)."""
    return record.get("utc") or "no timestamp"


# ------------------------------------------------------------------------------------------------
# Which network an evaluation reads
# ------------------------------------------------------------------------------------------------
def network_signature(ckpt):
    """{image_token, arch, tensors, parameters, keys_sha256} of the network eval_knn.py evaluates in
    a checkpoint of this repository (its teacher, or DRLoc's model)."""
    record = eval_knn.recorded_backbone(ckpt)
    state = ckpt["teacher"] if "teacher" in ckpt else ckpt["model"]
    # eval_knn.PooledViT: the backbone and the aggregation module
    if record.get("image_token") == "ca_head":
        state = {k: v for k, v in state.items() if k.startswith(("backbone.", "ca_head."))}
    else:
        state = eval_knn.backbone_state_dict(state)[0]
    keys = sorted(f"{k}:{list(v.shape)}" for k, v in state.items())
    return {"image_token": record.get("image_token", "backbone"), "arch": record["arch"],
            "tensors": len(keys),
            "parameters": sum(v.numel() for v in state.values()),
            "keys_sha256": hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]}


def checkpoint_signature(path):
    return network_signature(common.load_checkpoint(path))


METHOD_SCRIPTS = ("dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py")


def parse_training_command(command):
    """(method module, parsed args) of a logged `python SCRIPT.py FLAGS` training command. A log
    line is data: only a method file of this repository is imported for it, and only by name."""
    words = command.split() if isinstance(command, str) else []
    if len(words) < 2 or words[0] != "python" or words[1] not in METHOD_SCRIPTS:
        sys.exit(f"error: a logged command {str(command)[:60]!r} is not `python METHOD.py FLAGS` "
                 f"(METHOD.py one of {', '.join(METHOD_SCRIPTS)}): a log line is never imported or "
                 "run")
    module = importlib.import_module(words[1][:-3])     # a method file, read by the extras only
    try:
        with contextlib.redirect_stderr(io.StringIO()):     # argparse's usage: not this line's
            return module, module.get_args_parser().parse_args(words[2:])
    except SystemExit:
        sys.exit(f"error: the logged command {command[:60]!r}... does not parse with {words[1]}")


def initial_checkpoint(command, seed=None):
    """The network of a training command at its first step, as a checkpoint dict (the method's own
    build_model after common.fix_random_seeds(--seed), as its main() builds the student)."""
    module, args = parse_training_command(command)
    common.fix_random_seeds(args.seed if seed is None else seed)
    model = module.build_model(args, args.drop_path_rate)
    recorded = eval_knn.recorded_backbone({"args": vars(args), "method": module.__name__})
    image_token = recorded.get("image_token", "backbone")
    state = model.state_dict()
    return {"teacher": state, "student": state, "args": vars(args), "method": module.__name__,
            "backbone": common.backbone_record(model.backbone, image_token=image_token)}


def starting_checkpoint(command, path):
    """Write `command`'s network at its first step to `path` (a checkpoint eval_knn.py reads); its
    signature."""
    ckpt = initial_checkpoint(command)
    common.save_checkpoint(ckpt, path)  # its folder made, never through a symbolic link
    return network_signature(ckpt)


# ------------------------------------------------------------------------------------------------
# The evaluations of one row of compare.py, each a logged command with its wall and CPU seconds and
# the figures' lines of its output, and what the drivers read from that output
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
        output = run([sys.executable, *args], self.out / log_name)
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


# ------------------------------------------------------------------------------------------------
# Logs
# ------------------------------------------------------------------------------------------------
def check_trained(cmd, out):
    """Refuse a training that returned before its last epoch: a method script stopped by SIGTERM or
    SIGUSR1 writes its checkpoint and exits 0, to be resumed by the same command, so its exit status
    alone would let a half-trained network be evaluated and logged as the finished run."""
    log = Path(out) / "log.txt"
    try:
        planned = json.loads((Path(out) / "args.json").read_text())["epochs"]
        done = ([json.loads(line)["epoch"] for line in log.read_text().splitlines()]
                if log.exists() else [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {' '.join(cmd)} left no readable args.json / log.txt in {out} "
                 f"({type(e).__name__}: {e})")
    if not done or done[-1] != planned - 1:
        sys.exit(f"error: {' '.join(cmd)} stopped after {done[-1] + 1 if done else 0} of {planned} "
                 "epochs (a preemption signal?); nothing is logged: run the same command again to "
                 f"resume from {Path(out) / 'checkpoint.pth'}")


def run_from_root(args, *names):
    """Each path flag in `names` as the user meant it (from the folder they typed it in), then the
    repository root as the working folder, which the scripts run from: a path inside it becomes
    relative to it, the form the logged commands have; one outside it stays absolute."""
    for name in names:
        path = Path(getattr(args, name)).resolve()
        setattr(args, name, str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    os.chdir(ROOT)


def check_log_writable(path, what="--log"):
    """Before any training: the log each result is appended to can be written, else one line and
    exit 1 (found after an hour's run, a wrong path would lose its result)."""
    path = Path(path)
    if path.is_symlink():
        sys.exit(f"error: {what} {path} is a symbolic link: a log is never written through one; "
                 "nothing was run")
    if not path.parent.is_dir():
        sys.exit(f"error: {what} {path}: its folder {path.parent} does not exist; nothing was run")
    if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        reason = "a folder" if path.is_dir() else "no permission, or a read-only disk"
        sys.exit(f"error: {what} {path} cannot be written ({reason}); nothing was run")
    # a cut line (a killed append) would swallow the next record
    if path.is_file() and path.stat().st_size:
        read_log(path, what=what)


@contextlib.contextmanager
def locked(log):
    """The log, held by this process alone (processes of other seeds append to it or rewrite it). A
    rewrite (`rewrite_log`) replaces the file, so a process that waited on the old one takes the
    lock again on the new."""
    while True:
        if Path(log).is_symlink():
            sys.exit(f"error: {log} is a symbolic link: a log is never written through one; "
                     "remove it")
        f = open(log, "a")
        fcntl.flock(f, fcntl.LOCK_EX)      # released when f is closed
        if os.fstat(f.fileno()).st_ino == os.stat(log).st_ino:
            break
        f.close()
    with f:
        yield


def append_line(path, record, what="--log"):
    """Append `record` as one JSON line to `path` (held with `locked`): on a line of its own even
    after a last line without its newline, and never through a symbolic link (one line, exit 1)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        sys.exit(f"error: cannot append to {what} {path}: {e.strerror}"
                 + (" (a symbolic link)" if Path(path).is_symlink() else ""))
    with os.fdopen(fd, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        cut = size and os.pread(fd, 1, size - 1) != b"\n"
        f.write((("\n" if cut else "") + json.dumps(record) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def rewrite_log(log, lines):
    """Replace the log (held with `locked`) by `lines` atomically: a kill leaves the old log or the
    new, whole."""
    tmp = Path(log).with_name(f".{Path(log).name}.tmp{os.getpid()}")
    try:
        with common.open_for_writing(tmp) as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, log)
    finally:
        tmp.unlink(missing_ok=True)


def read_log(path, required=(), what="--log"):
    """The JSON records of a log; one line and exit 1 if it is missing, not a file, empty, not JSON
    lines, or a line lacks a `required` key (another script's log, e.g. a training log.txt), so that
    a mistyped path never becomes an empty or wrong table."""
    path = Path(path)
    if not path.exists():
        sys.exit(f"error: {what} {path} does not exist: nothing is written")
    if not path.is_file():
        sys.exit(f"error: {what} {path} is not a file: nothing is written")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: {what} {path} cannot be read as text ({type(e).__name__}): nothing is "
                 "written")
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"error: {what} {path} line {number} is not a JSON line: nothing is written")
        if not isinstance(record, dict):
            sys.exit(f"error: {what} {path} line {number} is not a JSON object: nothing is written")
        missing = [k for k in required if k not in record]
        if missing:
            sys.exit(f"error: {what} {path} line {number} has no {', '.join(missing)}: not this "
                     "script's log (a training log.txt?); nothing is written")
        records.append(record)
    if not records:
        sys.exit(f"error: {what} {path} holds no record: nothing is written")
    return records


# ------------------------------------------------------------------------------------------------
# What a generator reads from a log line, checked before any table is made
# ------------------------------------------------------------------------------------------------
def always(record):
    return True


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at(record, path):
    """record[a][b]... for path "a.b...", or a marker that it is missing."""
    for part in path.split("."):
        if not isinstance(record, dict) or part not in record:
            return MISSING
        record = record[part]
    return record


MISSING = object()
KINDS = {"number": is_number, "text": lambda v: isinstance(v, str),
         "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "number or null": lambda v: v is None or is_number(v),
         "list": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
         "true": lambda v: v is True}


def check_fields(records, path, fields, what="--log"):
    """Exit with one line unless every record holds, in the kind given, each field a generator
    reads: `fields` is [(dotted key, kind, whether the record needs it (a function of the record),
    whether it may be absent)] (kinds: KINDS' names, or a set of the allowed values)."""
    for number, record in enumerate(records, 1):
        for key, kind, applies, optional in fields:
            if not applies(record):
                continue
            value = at(record, key)
            if value is MISSING and optional:
                continue
            good = value in kind if isinstance(kind, (set, frozenset)) else \
                value is not MISSING and KINDS[kind](value)
            if not good:
                several = isinstance(kind, (set, frozenset))
                wanted = f"one of {sorted(kind)}" if several else f"a {kind}"
                found = "missing" if value is MISSING else f"{json.dumps(value)[:40]}"
                sys.exit(f"error: {what} {path} record {number}: {key} is {found}, not {wanted} "
                         "(the tables read it); nothing is written")
    return records
