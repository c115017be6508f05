"""The rows of extras/experiments/compare.py's controlled comparison, and the generated blocks of
docs/COMPARISON.md, README.md and docs/RESULTS.md made from its log (not a script). Every figure
is a logged value or computed from logged, unrounded values and rounded only when written: a gain
is a row's value minus that of its own network at random initialisation (`baseline_row`; a pairing
of two different networks is refused), a difference between methods that of their gains."""
import statistics
import sys

import claims
import provenance
import results
import split_ledger
from provenance import always

# ------------------------------------------------------------------------------------------------
# The rows: backbones, each method's own flags, the random-init rows, the summary's columns,
# and the fields of a log line that the tables and the curves read
# ------------------------------------------------------------------------------------------------
BACKBONES = {"vit": "--arch vit_pico --patch_size 4", "swin": "--arch swin_pico3 --fit_window true"}
# row: (backbone, script, the method's own flags)
METHOD_FLAGS = {
    "vit_dino": ("vit", "dino.py", ""),
    "vit_selfpatch": ("vit", "selfpatch.py", "--patch_out_dim 1024"),     # K_p = K
    "vit_esvit": ("vit", "esvit.py", "--use_region_loss true"),
    "vit_glsd": ("vit", "glsd.py", "--local_matching geometric"),
    "swin_dino": ("swin", "dino.py", ""),
    "swin_esvit": ("swin", "esvit.py", "--use_region_loss true"),
    "swin_glsd_geometric": ("swin", "glsd.py", "--local_matching geometric"),
    "swin_glsd_similarity": ("swin", "glsd.py", "--local_matching similarity"),
}
# random-init row: the row whose network (at its first step) it evaluates
RANDOM_ROWS = {"vit_random": "vit_dino", "swin_random": "swin_dino",
               "vit_selfpatch_random": "vit_selfpatch"}
ROWS = [*METHOD_FLAGS, *RANDOM_ROWS, "pixels"]
# column: {backbone: its row}; a backbone without the method shows n/a
SUMMARY_COLUMNS = {"DINO": {"vit": "vit_dino", "swin": "swin_dino"},
                   "EsViT": {"vit": "vit_esvit", "swin": "swin_esvit"},
                   "SelfPatch": {"vit": "vit_selfpatch"},
                   "GLSD geometric": {"vit": "vit_glsd", "swin": "swin_glsd_geometric"},
                   "GLSD similarity": {"swin": "swin_glsd_similarity"}}


def trained(r):
    return r.get("row") in METHOD_FLAGS


def evaluated(r):
    return r.get("row") != "pixels"


# every field of a log line that the tables and the curves read: (key, kind, for which lines,
# optional); provenance.check_fields refuses a line without them in one line
FIELDS = [("data", "text", always, False), ("row", set(ROWS), always, False),
          ("variant", "text", always, False), ("phase", {"val", "test"}, always, False),
          ("seed", "integer", always, False), ("steps", "integer", always, False),
          ("knn_top1", "number", always, False), ("utc", "text", always, True),
          ("withdrawn", "text", always, True),
          *((f"correspondence.{p}.{k}", "number", evaluated, False)
            for p, k in (("esvit", "top10_accuracy"), ("esvit", "accuracy"),
                         ("overlap", "accuracy"))),
          ("random_init", "true", lambda r: r.get("row") in RANDOM_ROWS, False),
          ("linear_top1", "number or null", evaluated, True),
          ("commands", "list", lambda r: trained(r) and "network" not in r, False),
          ("network", "object", evaluated, True), ("start_of", "text", evaluated, True),
          ("train_seconds", "number", evaluated, True),
          ("peak_memory_mb", "number", evaluated, True),
          ("teacher_entropy", "number", evaluated, True),
          ("mean_target_entropy", "number", evaluated, True),
          ("ln_k", "number", lambda r: "teacher_entropy" in r or "mean_target_entropy" in r, False),
          ("cpu_seconds", "object", evaluated, True), ("curve", "list", trained, True),
          ("machine", "object", lambda r: "utc" in r, True), ("extra", "text", always, True),
          ("knn_top1_by_k", "object", always, True)]
CURVE_FIELDS = [("step", "integer", always, False), ("knn_top1", "number", always, False),
                ("overlap_accuracy", "number", always, False)]


cell = results.cell
TAG = "compare.py"
# images a read-out is evaluated on: its binomial error (the correspondence: its first
# provenance.CORRESPONDENCE_IMAGES)
IMAGES = {"fashion_mnist": 10000, "fashion_mnist_8k": 2000, "shapes": 2000}


def read_checked(path, what="--log"):
    """The comparison log's records, each holding every field the tables and the curves read (one
    line and exit 1 if not: a line is data, checked before it is used)."""
    records = provenance.read_log(path, ("data", "row", "variant", "phase", "seed"), what=what)
    provenance.check_fields(records, path, FIELDS, what=what)
    for r in records:
        where = f"{path} ({r['row']} seed {r['seed']}'s curve)"
        provenance.check_fields(r.get("curve") or [], where, CURVE_FIELDS, what=what)
    return records


def baseline_row(row):
    """The random-init row of a method row's network: its own, or its backbone's DINO row's."""
    return next((r for r, source in RANDOM_ROWS.items() if source == row),
                f"{METHOD_FLAGS[row][0]}_random")


def log_key(record):
    """What names a row's line in the log: (data, row, variant, phase, seed)."""
    return tuple(record.get(k) for k in ("data", "row", "variant", "phase", "seed"))


def current(records):
    """The log's lines the tables show: a line written before stamps existed gives way to its row
    run again and stamped; a withdrawn line (restored to the log) is shown apart."""
    kept = [r for r in records if not r.get("withdrawn")]
    stamped = {log_key(r) for r in kept if r.get("utc")}
    return [r for r in kept if r.get("utc") or log_key(r) not in stamped]


def split_reruns(records):
    """(the lines shown as results, the reruns): a test line that trains again the setting (data,
    row, seed, steps, extra flags) of an earlier line of another variant (DINO's four k: the same
    command, a further use of the test split) is a rerun, shown in the appendix only."""
    first, shown, again = {}, [], []
    for r in records:
        key = (r["data"], r["row"], r["phase"], r["seed"], r["steps"], r.get("extra", ""))
        first.setdefault(key, r["variant"])
        (again if r["phase"] == "test" and first[key] != r["variant"] else shown).append(r)
    return shown, again


def test_uses(rs, entries):
    """The ledger's count beside the figures: which test use of its row each line is."""
    return split_ledger.use_notes(
        rs, entries, lambda r: (TAG, r["data"], r["row"], r["seed"], r["steps"], "row"),
        lambda r: r["knn_top1"])


def network_of(record):
    """The network a logged row evaluated, from its signature (every line the tables show logs
    one; the lines without are the unstamped ones their stamped reruns replaced)."""
    network = record.get("network") or {}
    return " ".join(str(network.get(k, "not logged")) for k in ("arch", "image_token",
                                                              "keys_sha256"))


def baselines(records, data, phase):
    """{(random-init row, seed): its first record} of one comparison, any variant (the
    initialisation depends on the network and the seed only)."""
    found = {}
    for r in records:
        if r.get("random_init") and (r["data"], r["phase"]) == (data, phase):
            found.setdefault((r["row"], r["seed"]), r)
    return found


def value(record, key):
    """A read-out of a line: knn_top1, linear_top1, or "overlap" (the `overlap` all-token accuracy
    of its correspondence); None where it has none."""
    if key == "overlap":
        return ((record.get("correspondence") or {}).get("overlap") or {}).get("accuracy")
    return record.get(key)


def gains(rs, base, key="knn_top1"):
    """value(rs[i], key) minus that of its own network's random init, seed by seed; None unless
    every record has one. Exits with one line if a pair would be two different networks."""
    out = []
    for r in rs:
        b = base.get((baseline_row(r["row"]), r["seed"]))
        if b is None or value(r, key) is None or value(b, key) is None:
            return None
        mine, theirs = (network_of(x) for x in (r, b))
        if mine != theirs or "network" not in r:
            sys.exit(f"error: {r['row']} ({r['variant']}, seed {r['seed']}) cannot be paired with "
                     f"{b['row']}: another network, or none logged ({mine} vs {theirs}); log its "
                     "own random-init row")
        out.append(value(r, key) - value(b, key))
    return out


def signed(values, digits=1):
    text = cell(values, digits) if values else "—"
    return text if text == "—" or text.startswith("-") else f"+{text}"


def logged_dates(rs):
    return " / ".join(sorted({r["utc"][:10] if r.get("utc") else "no timestamp" for r in rs}))


def validated(records, row, variant):
    """Whether a row's setting under this variant (its steps and --extra flags) ran on the
    validation split (Fashion-MNIST's: the settings of every dataset are chosen there), under any
    variant name: a variant that trains a validated setting again (`fourk`) is not test-only."""
    settings = {(r["steps"], r.get("extra", "")) for r in records
                if (r["row"], r["variant"]) == (row, variant)}
    return any(r["phase"] == "val" and r["row"] == row
               and (r["steps"], r.get("extra", "")) in settings for r in records)


def train_minutes(rs):
    """The seeds' train times: mean ± half-range, or each seed's with its thread count where the
    seeds trained on different numbers of threads (a mean of the two would describe neither)."""
    if not all("train_seconds" in r for r in rs):
        return "—"
    threads = [r.get("machine", {}).get("threads") for r in rs]
    if len(set(threads)) == 1:
        return cell([r["train_seconds"] / 60 for r in rs])
    return ", ".join(f"{r['train_seconds'] / 60:.1f} ({t or '?'} thread{'' if t == 1 else 's'})"
                     for r, t in zip(rs, threads))


def comparison_table(records, data, phase, entries=None, shown=None):
    """The markdown table of one comparison: a line per (variant, row) in the order the log first
    holds the variants and ROWS' order within one; the lines of `shown` (default: all), each gain
    over a random init of `records`. With the ledger's `entries`, a test table says which test
    use of its row, seed and budget each figure is."""
    uses = entries is not None and phase == "test"
    lines = ["| row | variant | steps | seeds | 20-NN top-1 (%) | 20-NN gain | linear top-1 (%) | "
             "linear gain | "
             "flip: top-10 / all-token acc. (%) | overlap: all-token acc. (%) | h / ln K | "
             "h̄ / ln K | "
             "train time (min) | peak memory (MB) | logged (UTC) |"
             + (" test use (seed: use of the row's uses) |" if uses else ""),
             "|---" * (15 + uses) + "|"]
    chosen = [r for r in (records if shown is None else shown)
              if r["data"] == data and r["phase"] == phase]
    base = baselines(records, data, phase)
    groups = {}
    for r in chosen:
        groups.setdefault(r["variant"], {}).setdefault(r["row"], []).append(r)
    for variant, by_row in groups.items():
        for row in ROWS:
            rs = by_row.get(row)
            if not rs:
                continue
            if row == "pixels":
                pixels = f"| raw pixels | — | — | — | {rs[0]['knn_top1']:.1f} |"
                lines.append(pixels + " — |" * 9 + f" {logged_dates(rs)} |"
                             + (f" {test_uses(rs[:1], entries)} |" if uses else ""))
                continue
            steps = "—" if row in RANDOM_ROWS else "/".join(sorted({str(r["steps"]) for r in rs}))
            chosen = phase == "val" or row in RANDOM_ROWS or validated(records, row, variant)
            shown = variant if chosen else f"{variant} (test only)"
            knn_gain, linear_gain = ((None, None) if row in RANDOM_ROWS else
                                     (gains(rs, base),
                                      gains(rs, base, "linear_top1")))
            corr = [r["correspondence"] for r in rs]
            flip = (f"{cell([c['esvit']['top10_accuracy'] for c in corr])} / "
                    f"{cell([c['esvit']['accuracy'] for c in corr])}")
            overlap = cell([c["overlap"]["accuracy"] for c in corr])
            entropy = [cell([r[k] / r["ln_k"] for r in rs], 2) if all(k in r for r in rs) else "—"
                       for k in ("teacher_entropy", "mean_target_entropy")]
            minutes = train_minutes(rs)
            memory = (str(max(r["peak_memory_mb"] for r in rs))
                      if all("peak_memory_mb" in r for r in rs) else "—")
            lines.append(f"| {row} | {shown} | {steps} | {len(rs)} | "
                         f"{cell([r['knn_top1'] for r in rs])} | {signed(knn_gain)} | "
                         f"{cell([r.get('linear_top1') for r in rs])} | {signed(linear_gain)} | "
                         f"{flip} | {overlap} | {entropy[0]} | {entropy[1]} | {minutes} | {memory} "
                         f"| {logged_dates(rs)} |"
                         + (f" {test_uses(rs, entries)} |" if uses else ""))
    if len(lines) == 2:
        return f"No {phase}-phase run of the comparison on {data} is logged yet."
    return "\n".join(lines)


def error_of(rs, data, key):
    """The binomial error of one evaluation of the read-out `key` at the worst accuracy of `rs`."""
    images = provenance.CORRESPONDENCE_IMAGES if key == "overlap" else IMAGES[data]
    return claims.binomial_error([value(r, key) for r in rs], images)


def verdict_of(diffs, rs, data, key):
    """`diffs` (seed by seed) as the rule judges them: "+0.82: finding" (claims.finding)."""
    if not diffs:
        return "—"
    return f"{statistics.mean(diffs):+.2f}: {claims.finding(diffs, error_of(rs, data, key))}"


def summary_table(records, entries=(), data="fashion_mnist", phase="test", variant="recipe"):
    """The README's glance at the comparison: per backbone and method, the 20-NN, its gain over its
    own network at random init, what it adds over DINO (20-NN / linear gain minus DINO's, with the
    rule's verdict) and which test use of its row each seed's figure is."""
    chosen = [r for r in records if (r["data"], r["phase"],
                                     r["variant"]) == (data, phase, variant) and "backbone" in r]
    base = baselines(records, data, phase)
    found = differences(records, data, phase, variant)
    lines = ["| backbone | method | 20-NN top-1 (%) | gain over its random init | over DINO: 20-NN "
             "/ linear | test use (seed: use of the row's uses) |", "|---" * 6 + "|"]
    for backbone, flags in BACKBONES.items():
        random = sorted((r for (row, _), r in base.items() if row == f"{backbone}_random"),
                        key=lambda r: r["seed"])
        if not random:
            continue
        arch = f"`{flags.split()[1]}`"
        lines.append(f"| {arch} | random init | {cell([r['knn_top1'] for r in random])} | — | "
                     f"— | {test_uses(random, entries)} |")
        for method, rows in SUMMARY_COLUMNS.items():
            rs = sorted((r for r in chosen if r["row"] == rows.get(backbone)),
                        key=lambda r: r["seed"])
            if not rs:
                continue
            gain = gains(rs, base)
            own = baseline_row(rs[0]["row"])
            own_random = cell([base[(own, r["seed"])]["knn_top1"] for r in rs])
            note = (f" (over its own random init {own_random})"
                    if own != f"{backbone}_random" else "")
            untried = ("" if validated(records, rs[0]["row"], variant)
                       else " (not run on validation)")
            added = "—"
            if rs[0]["row"] in found:
                dino = [r for r in chosen if r["row"] == f"{backbone}_dino"]
                added = " / ".join(verdict_of(found[rs[0]["row"]][1][k][1], rs + dino, data, k)
                                   for k in ("knn_top1", "linear_top1"))
            lines.append(f"| {arch} | {method}{untried} | {cell([r['knn_top1'] for r in rs])} | "
                         f"{signed(gain)}{note} | {added} | {test_uses(rs, entries)} |")
    if len(lines) == 2:
        return f"No {phase}-phase run of the comparison on {data} is logged yet."
    return "\n".join(lines)


def differences(records, data="fashion_mnist", phase="test", variant="recipe"):
    """{row: (seeds, {key: (its gains, its gains minus the DINO row's)})} of the method rows of one
    comparison, seed by seed (each gain over its own network's random init), key: knn_top1 and
    linear_top1; None where a value is missing."""
    chosen = [r for r in records if (r["data"], r["phase"], r["variant"]) == (data, phase, variant)
              and r["row"] in METHOD_FLAGS]
    base = baselines(records, data, phase)
    found = {}
    for row, (backbone, _, _) in METHOD_FLAGS.items():
        dino = {r["seed"]: r for r in chosen if r["row"] == f"{backbone}_dino"}
        rs = sorted((r for r in chosen if r["row"] == row and r["seed"] in dino),
                    key=lambda r: r["seed"])
        if not rs or row.endswith("_dino"):
            continue
        found[row] = (len(rs), {})
        for key in ("knn_top1", "linear_top1"):
            mine = gains(rs, base, key)
            theirs = gains([dino[r["seed"]] for r in rs], base, key)
            found[row][1][key] = (mine, [a - b for a,
                                         b in zip(mine, theirs)] if mine and theirs else None)
    return found


def long_budget_table(records, entries=(), data="fashion_mnist"):
    """The rows trained longer than the shared budget's 400 steps, validation first: 20-NN and its
    gain over the row's own random init, and the 20-NN minus the raw pixels' of the same split (the
    same k-NN on the pixels of the same 32 px evaluation transform), seed by seed; on test, which
    use of the test split each seed's figure is."""
    lines = ["| row | phase | variant | steps | seeds | 20-NN top-1 (%) | 20-NN gain | minus raw "
             "pixels (seed 0, 1, ...) | linear top-1 (%) | logged (UTC) | test use (seed: use of "
             "the row's uses) |", "|---" * 11 + "|"]
    for phase in ("val", "test"):
        base = baselines(records, data, phase)
        groups = {}
        pixels = next((r["knn_top1"] for r in records
                       if (r["data"], r["phase"], r["row"]) == (data, phase, "pixels")), None)
        for r in records:
            if ((r["data"], r["phase"]) == (data, phase) and r["row"] in METHOD_FLAGS
                    and r["steps"] > 400):
                groups.setdefault((r["row"], r["variant"], r["steps"]), []).append(r)
        for (row, variant, steps), rs in sorted(groups.items(),
                                                key=lambda item: (item[0][2], item[0][0])):
            rs = sorted(rs, key=lambda r: r["seed"])
            below = [r["knn_top1"] - pixels for r in rs] if pixels is not None else None
            chosen = phase == "val" or validated(records, row, variant)
            shown = variant if chosen else f"{variant} (test only)"
            lines.append(f"| {row} | {phase} | {shown} | {steps} | {len(rs)} | "
                         f"{cell([r['knn_top1'] for r in rs])} | "
                         f"{signed(gains(rs, base))} | "
                         + (f"{signed(below)} ({', '.join(f'{d:+.2f}' for d in below)})"
                            if below else "—")
                         + f" | {cell([r.get('linear_top1') for r in rs])} | {logged_dates(rs)} | "
                         + (test_uses(rs, entries) if phase == "test" else "—") + " |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No row longer than 400 steps on {data} is logged yet.")


def long_glance_table(records, entries=(), data="fashion_mnist"):
    """The README's glance at the longer budget: each row trained past 400 steps on both splits (how
    its budget was reached: COMPARISON.md and the test ledger), with its test 20-NN, that minus
    the test split's raw pixels, and the train time of every seed that logged one."""
    pixels = next((r["knn_top1"] for r in records
                   if (r["data"], r["phase"], r["row"]) == (data, "test", "pixels")), None)
    method = {row: name for name, rows in SUMMARY_COLUMNS.items() for row in rows.values()}
    groups = {}
    for r in records:
        if r["data"] == data and r["row"] in METHOD_FLAGS and r["steps"] > 400:
            by_phase = groups.setdefault((r["row"], r["variant"], r["steps"]), {})
            by_phase.setdefault(r["phase"], []).append(r)
    lines = ["| backbone | method | steps | seeds: validation, test | test 20-NN top-1 (%) | minus "
             "raw pixels (seed 0, 1, ...) | test use (seed: use of the row's uses) "
             "| train time (min): split, seed, threads |", "|---" * 8 + "|"]

    def order(group):
        (row, _, steps), _ = group
        return METHOD_FLAGS[row][0] != "swin", steps, row

    for (row, variant, steps), split in sorted(groups.items(), key=order):
        if not {"val", "test"} <= set(split):
            continue
        val, test = (sorted(split[phase], key=lambda r: r["seed"]) for phase in ("val", "test"))
        below = [r["knn_top1"] - pixels for r in test] if pixels is not None else None
        timed = [(r["train_seconds"] / 60, r["phase"], r["seed"],
                  r.get("machine", {}).get("threads") or "?")
                 for r in val + test if "train_seconds" in r]      # a resumed training logs no time
        times = ", ".join(f"{m:.1f} ({phase} {seed}, {t} thread{'' if t == 1 else 's'})" for m,
                          phase, seed, t in timed)
        lines.append(f"| `{BACKBONES[METHOD_FLAGS[row][0]].split()[1]}` | {method[row]} | {steps} "
                     f"| {len(val)}, {len(test)} | {cell([r['knn_top1'] for r in test])} | "
                     + (f"{signed(below)} ({', '.join(f'{d:+.2f}' for d in below)})"
                        if below else "—")
                     + f" | {test_uses(test, entries)} | {times or '—'} |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No row longer than 400 steps on {data} has run on both splits yet.")


READOUTS = {"knn_top1": "20-NN", "linear_top1": "linear probe", "overlap": "overlap"}


def findings(records, data, phase, variant):
    """Every comparison the tables hold for one run (data, phase, variant), as the rule judges it:
    each trained row against its own network at random init, each method against DINO on its
    backbone (gain minus DINO's gain), and, past the shared 400 steps, each row against the raw
    pixels (20-NN): [(row, compared with, {read-out: claims.told text or None})]."""
    chosen = [r for r in records if (r["data"], r["phase"], r["variant"]) == (data, phase, variant)
              and r["row"] in METHOD_FLAGS]
    base = baselines(records, data, phase)
    pixels = next((r for r in records
                   if (r["data"], r["phase"], r["row"]) == (data, phase, "pixels")), None)
    by_row = {}
    for r in sorted(chosen, key=lambda r: r["seed"]):
        by_row.setdefault(r["row"], []).append(r)
    said = []

    def told(diffs, rs, key):
        return claims.told(diffs, error_of(rs, data, key)) if diffs else None
    for row in (r for r in ROWS if r in by_row):
        rs = by_row[row]
        random = [base[(baseline_row(row), r["seed"])] for r in rs
                  if (baseline_row(row), r["seed"]) in base]
        said.append((row, f"its random init ({baseline_row(row)})",
                     {k: told(gains(rs, base, k), rs + random, k) for k in READOUTS}))
        dino = {r["seed"]: r for r in by_row.get(f"{METHOD_FLAGS[row][0]}_dino", [])}
        if not row.endswith("_dino") and all(r["seed"] in dino for r in rs):
            theirs = [dino[r["seed"]] for r in rs]
            said.append((row, f"{METHOD_FLAGS[row][0]}_dino (gain minus its gain)", {
                k: told([a - b for a, b in zip(gains(rs, base, k) or [],
                                                  gains(theirs, base, k) or [])],
                        rs + theirs, k) for k in READOUTS}))
        if pixels and rs[0]["steps"] > 400:
            said.append((row, "the raw pixels (20-NN)", {
                "knn_top1": told([r["knn_top1"] - pixels["knn_top1"] for r in rs], rs + [pixels],
                                 "knn_top1")}))
    return said


def findings_table(records, runs):
    """The generated findings of `runs` ([(data, phase, variant)]): one line per comparison, each
    read-out's mean difference, its seeds, the binomial error and the verdict of claims.finding."""
    lines = ["| data, split, variant | row | compared with | " + " | ".join(READOUTS.values())
             + " |", "|---" * (3 + len(READOUTS)) + "|"]
    for data, phase, variant in runs:
        steps = next(r["steps"] for r in records
                     if (r["data"], r["phase"], r["variant"]) == (data, phase, variant))
        for row, other, told in findings(records, data, phase, variant):
            cells = [told.get(k) or "—" for k in READOUTS]
            only = "" if phase == "val" or validated(records, row, variant) else " (test only)"
            lines.append(f"| {data}, {phase}, {variant} ({steps} steps){only} | {row} | {other} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else "No comparison is logged yet."
