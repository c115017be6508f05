"""The test split's ledger (docs/data/test_ledger.jsonl): every evaluation on a test split, one
line written as it is about to read the first test image and never rewritten; its result, and any
later wording of its reason, appended as lines of their own. Used by extras/experiments/compare.py,
results.py and quickstart.py (which refuse a second test use without a reason: `ledger_guard`;
their shared flags: `add_driver_args`; their log lines: `log_result`) and by their generators."""
import json
import os
import re
import sys
from pathlib import Path

from provenance import (ROOT, append_line, check_log_writable, cpu_model, is_number, locked,
                        read_log, start, utc_now)

LEDGER = ROOT / "docs" / "data" / "test_ledger.jsonl"
# what names one test use: the same key twice is a second look at the test split
LEDGER_KEY = ("driver", "data", "row", "seed", "budget", "evaluation")


def add_driver_args(parser, work_dir, log, variant="recipe", data_dir=False):
    """The flags of every driver (--ledger and --reason: the ledger's): its runs' folder under
    runs/ (`work_dir`), its log under docs/data/ (`log`), and the built datasets' (`data_dir`)."""
    parser.add_argument("--variant", default=variant,
                        help="name under which a variant (--extra) is logged")
    parser.add_argument("--extra", default="", help="training flags added to the recipe's")
    parser.add_argument("--work_dir", default=str(ROOT / "runs" / work_dir),
                        help="output directories of the runs")
    if data_dir:
        parser.add_argument("--data_dir", default=str(ROOT / "runs" / "data"),
                            help="where compare.py's built datasets (fashion_mnist_8k) are written")
    parser.add_argument("--log", default=str(ROOT / "docs" / "data" / log),
                        help="one JSON line per run is appended here")
    parser.add_argument("--table", action="store_true",
                        help="rewrite the generated blocks of the documents from --log")
    parser.add_argument("--ledger", default=str(LEDGER),
                        help="every test-phase run is appended here before it starts")
    parser.add_argument("--reason", default="", help="why a test evaluation is repeated (refused "
                        "without one); the ledger and the documents show it")
    return parser


def read_ledger(path):
    """The ledger's lines, checked and normalised ([] when it does not exist yet); one line and
    exit 1 if it is unreadable or a line holds a field of the wrong kind."""
    if not Path(path).exists() or Path(path).is_file() and Path(path).stat().st_size == 0:
        return []               # an empty file is made by `locked`: no use yet
    return check_entries(read_log(path, required=("kind",), what="--ledger"), path)


def whole_number(value):
    """An integer given as one (or as a string of digits: "0"); else None."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_text(value):
    return isinstance(value, str) and value.strip() != ""


def is_result(value):
    numbers = value if isinstance(value, list) else [value]
    return value is None or all(is_number(v) for v in numbers)


# kind: {field: (what it must be, test)}; seed and budget are normalised to int first
FIELDS = {"use": {"id": ("a text", is_text), "driver": ("a text", is_text),
                  "data": ("a text", is_text), "row": ("a text", is_text),
                  "seed": ("an integer", lambda v: isinstance(v, int)),
                  "budget": ("an integer or null", lambda v: v is None or isinstance(v, int)),
                  "evaluation": ("a text", is_text), "command": ("a text", is_text),
                  "reason": ("a text", is_text)},
          "result": {"id": ("a text", is_text),
                     "result": ("a number, a list of numbers or null", is_result)},
          "reason": {"id": ("a text", is_text), "reason": ("a text", is_text)}}


def check_entries(entries, path):
    """`entries` with kind lower-cased and seed and budget made integers ("0" is 0: the same use
    key as 0), or one line and exit 1 naming the first field that is missing or of another kind."""
    checked = []
    for number, entry in enumerate(entries, 1):
        entry = dict(entry)
        kind = entry["kind"].strip().lower() if isinstance(entry["kind"], str) else entry["kind"]
        if kind not in FIELDS:
            sys.exit(f"error: --ledger {path} record {number}: kind {json.dumps(kind)[:40]} is not "
                     f"one of {', '.join(FIELDS)}; nothing is written")
        entry["kind"] = kind
        for field in ("seed", "budget"):
            if kind == "use" and entry.get(field) is not None:
                normal = whole_number(entry[field])
                entry[field] = entry[field] if normal is None else normal
        for field, (wanted, good) in FIELDS[kind].items():
            if field not in entry or not good(entry[field]):
                found = json.dumps(entry[field])[:40] if field in entry else "missing"
                sys.exit(f"error: --ledger {path} record {number} ({kind}): {field} is {found}, "
                         f"not {wanted}; nothing is written")
        checked.append(entry)
    return checked


def test_uses(entries, key):
    """The ledger's uses of `key` (its `use` lines, reconstructed or not, withdrawn ones included:
    a withdrawn result was still seen)."""
    return [e for e in entries
            if e["kind"] == "use" and tuple(e.get(k) for k in LEDGER_KEY) == key]


def use_key(use):
    """The key of a use about to be recorded, normalised as the ledger's lines are."""
    key = dict(use)
    for field in ("seed", "budget"):
        if whole_number(key.get(field)) is not None:
            key[field] = whole_number(key[field])
    return tuple(key.get(k) for k in LEDGER_KEY)


def check_test_use(path, use, reason=""):
    """Before any training: refuse (one line, exit 1) a use of a key the ledger already holds,
    unless `reason` says why the test split is read again; the earlier uses."""
    earlier = test_uses(read_ledger(path), use_key(use))
    if earlier and not reason.strip():
        sys.exit(f"error: the test split was evaluated for {use['row']} seed {use['seed']} at "
                 f"budget {use['budget']} ({use['evaluation']}) {len(earlier)} time(s) already "
                 f"(last {earlier[-1].get('started_utc') or 'no time'}); give --reason \"...\" "
                 "to do it again")
    return earlier


def record_test_use(path, use, reason=""):
    """Append `use` ({driver, data, row, seed, budget, evaluation, command}) to the ledger at `path`
    when the first test image is about to be read (after training: a run stopped in training has
    not seen the test split), stamped with its time, commit and machine; its id. A key used
    before is refused (one line, exit 1) unless `reason` says why the test split is read again."""
    check_log_writable(path, what="--ledger")
    started = start()
    with locked(path):
        earlier = check_test_use(path, use, reason)
        key = dict(zip(LEDGER_KEY, use_key(use)))
        entry = {"kind": "use", **key, "command": use["command"],
                 "reason": reason.strip() or "first use", "use_number": len(earlier) + 1,
                 "id": f"{started['started_utc']}-{os.getpid()}-{len(earlier) + 1}",
                 "started_utc": started["started_utc"], "commit": started["commit"],
                 "uncommitted": started["uncommitted"],
                 "machine": {"cpu": cpu_model(), "cores": os.cpu_count()}}
        append_line(path, entry, what="--ledger")
    return entry["id"]


def ledger_guard(path, use, reason, test=True):
    """A driver's test use (`use`: its key and command; `test` false: the val phase, nothing): one
    of a key the ledger holds is refused now, before any training, without `reason`; the function
    returned records it when first called, as the first test image is about to be read, and keeps
    its id as `.id` (None until then)."""
    if test:
        check_test_use(path, use, reason)

    def record():
        if test and record.id is None:
            record.id = record_test_use(path, use, reason)
        return record.id
    record.id = None
    return record


def log_result(args, record, result):
    """Append a driver's `record` to its --log, then the `result` of its test use to the ledger."""
    with locked(args.log):
        append_line(args.log, record)
    if record.get("test_use"):
        record_test_result(args.ledger, record["test_use"], result)


def record_test_result(path, use_id, result):
    """Append the result of the use `use_id` (its own line: the use's line is never rewritten)."""
    with locked(path):
        append_line(path, {"kind": "result", "id": use_id, "result": result, "utc": utc_now()},
                    what="--ledger")


def uses_with_results(entries):
    """Each `use` line of the ledger with its result (from its `result` line, if one was
    written) and its reason as last worded (a `reason` line; the use's own line keeps the first)."""
    found = {e["id"]: e["result"] for e in entries if e["kind"] == "result"}
    reworded = {e["id"]: e["reason"] for e in entries if e["kind"] == "reason"}
    return [{**e, "result": e.get("result", found.get(e.get("id"))),
             "reason": reworded.get(e.get("id"), e.get("reason"))}
            for e in entries if e["kind"] == "use"]


def when_used(entry):
    """The time a use is ordered by: its start, or (a use reconstructed from the logs' history) the
    time of the first commit that logged it, which it preceded."""
    found = re.search(r"\((\d{4}-\d\d-\d\dT[\d:]+Z)\)", entry.get("from") or "")
    return entry.get("started_utc") or (found.group(1) if found else "")


def use_numbers(entries):
    """{use id: (its number among the uses of its key in time order, the key's number of uses)}."""
    groups = {}
    for e in entries:
        if e["kind"] == "use":
            groups.setdefault(tuple(e[k] for k in LEDGER_KEY), []).append(e)
    numbers = {}
    for uses in groups.values():
        for n, e in enumerate(sorted(uses, key=when_used), 1):
            numbers[e["id"]] = (n, len(uses))
    return numbers


def use_of(entries, key, record, value):
    """The ledger's use that produced a log line: its `test_use` id, else (a line logged before
    the ledger) the reconstructed use of its key with the same result; None if neither."""
    uses = test_uses(entries, key)
    if any(e["id"] == record.get("test_use") for e in uses):
        return record["test_use"]
    same = [e for e in uses if e.get("reconstructed") and e.get("result") == value]
    started = [e for e in same if e.get("started_utc") == record.get("started_utc")]
    return (started or same or [{"id": None}])[0]["id"]


def use_note(entries, key, record, value):
    """"use 3 of 4": which test use of its key (driver, data, row, seed, budget, evaluation) a
    shown figure is, and how many the ledger holds; "use ? of 4" where the line names none."""
    uses = test_uses(entries, key)
    if not uses:
        return "no use in the ledger"
    found = use_of(entries, key, record, value)
    number = use_numbers(entries)[found][0] if found else "?"
    return f"use {number} of {len(uses)}"


def use_notes(rs, entries, key_of, value_of):
    """Which test use of its key (`key_of(line)`) each line is, seed by seed ("0: use 2 of 3, 1:
    ..."), found by its `test_use` id or, before the ledger, by its value (`value_of(line)`)."""
    return ", ".join(f"{r['seed']}: {use_note(entries, key_of(r), r, value_of(r))}"
                     for r in sorted(rs, key=lambda r: r["seed"]))


def uncommitted_code(entry, top_level=False):
    """Whether a use ran with a Python file that differed from its commit (top_level: a method file,
    common.py or an evaluation script, the code that computes the figure)."""
    return any(f.endswith(".py") and not (top_level and "/" in f)
               for f in entry.get("uncommitted") or [])


def withdrawn_table(entries, drivers):
    """Every withdrawn test use of `drivers` with its value: a result taken out of the tables (or
    never logged) was still seen, and is listed here."""
    lines = ["| driver | data | row | seed | budget | result | first logged or published | why "
             "withdrawn |", "|---" * 8 + "|"]
    for e in uses_with_results(entries):
        if e["driver"] in drivers and e.get("withdrawn"):
            budget = e["budget"] if e["budget"] is not None else "—"
            lines.append(f"| {e['driver']} | {e['data']} | {e['row']} | {e['seed']} | {budget} | "
                         f"{e['result']} | {e.get('from') or e.get('started_utc')} | "
                         f"{e['withdrawn']} |")
    return "\n".join(lines) if len(lines) > 2 else "No test use is withdrawn."


def ledger_table(entries, drivers, unit):
    """The documents' count of test uses, from the ledger: per (driver, data, row, budget), each
    seed's number of test evaluations, the withdrawn ones, how many lines were reconstructed from
    the logs' history, which ran on uncommitted code or name a commit younger than their start, and
    the reasons given for a later use, each written once under the table (R1, R2, ...)."""
    groups, numbered = {}, {}
    for e in uses_with_results(entries):
        if e["driver"] in drivers:
            key = (e["driver"], e["data"], e["row"], e["budget"])
            groups.setdefault(key, []).append(e)
    lines = [f"| driver | data | row | budget ({unit}) | test uses per seed (evaluation: seed × "
             "uses) | withdrawn | reconstructed | uncommitted code: top-level .py, any .py | "
             "commit younger than start | reasons given |", "|---" * 10 + "|"]
    for (driver, data, row, budget), es in groups.items():
        per_seed = {}
        for e in es:
            counts = per_seed.setdefault(e["evaluation"], {})
            counts[e["seed"]] = counts.get(e["seed"], 0) + 1
        uses = "; ".join(f"{evaluation}: "
                         + ", ".join(f"{seed} × {n}" for seed, n in counts.items())
                         for evaluation, counts in per_seed.items())
        reasons = sorted({numbered.setdefault(e["reason"], f"R{len(numbered) + 1}")
                          for e in es if not e.get("reconstructed") and e["reason"] != "first use"},
                         key=lambda n: int(n[1:]))

        def count(test):
            return str(sum(1 for e in es if test(e)))
        lines.append(f"| {driver} | {data} | {row} | {budget if budget is not None else '—'} | "
                     f"{uses} | {count(lambda e: e.get('withdrawn'))} | "
                     f"{count(lambda e: e.get('reconstructed'))} | "
                     f"{count(lambda e: uncommitted_code(e, top_level=True))}, "
                     f"{count(uncommitted_code)} | "
                     f"{count(lambda e: e.get('commit_younger_than_start'))} | "
                     f"{', '.join(reasons) or '—'} |")
    if len(lines) == 2:
        return "No test evaluation is in the ledger yet."
    return "\n".join(lines + [""] + [f"- {n}: {reason}" for reason, n in numbered.items()])
