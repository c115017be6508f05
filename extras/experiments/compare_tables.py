"""The generated blocks of docs/COMPARISON.md, README.md and docs/RESULTS.md that are made from
the log of extras/experiments/compare.py's controlled comparison (its rows: compare_rows.py; not a
script).

Every figure in a block is a logged value or is computed here from logged, unrounded values: a gain
is a row's value minus that of its own network at random initialisation (same seed, same read-out,
`baseline_row`), a difference between methods is the difference of their gains seed by seed; both
are rounded only when written. A pairing of two different networks (state-dict keys and shapes, or
image token: provenance.network_signature) is refused with one line. Lines logged before stamps
existed are marked "no timestamp"; once their row is run again (`compare.py --relog`) the stamped
line replaces them, and `relogged_table` sets the two side by side.
"""
import json
import re
import statistics
import sys

import provenance
import results

from compare_rows import (BACKBONES, CURVE_FIELDS, FIELDS, METHOD_FLAGS,  # noqa: F401
                          RANDOM_ROWS, ROWS, SUMMARY_COLUMNS, always, evaluated, trained)

cell = results.cell


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
    """(the log's lines the tables show, [(a line without a timestamp, its row run again and
    stamped)]): `compare.py --relog` runs the rows of such lines again with the same command."""
    kept = [r for r in records if not r.get("withdrawn")]    # restored to the log, shown apart
    return provenance.superseded(kept, log_key)


def withdrawn_table(records):
    """The lines taken out of the tables (restored to the log with the reason): their figures."""
    lines = ["| row | data | phase | variant | seed | steps | 20-NN top-1 (%) | linear top-1 (%) | "
             "logged (UTC) | why withdrawn |", "|---" * 10 + "|"]
    for r in records:
        if r.get("withdrawn"):
            linear = f"{r['linear_top1']:.2f}" if r.get("linear_top1") is not None else "—"
            lines.append(f"| {r['row']} | {r['data']} | {r['phase']} | {r['variant']} | "
                         f"{r['seed']} | {r['steps']} | {r['knn_top1']:.2f} | {linear} | "
                         f"{provenance.when(r)} | {r['withdrawn']} |")
    return "\n".join(lines) if len(lines) > 2 else "No line of the log is withdrawn."


def relogged_table(pairs):
    """Each line logged again with its stamp: its figures then and now, now minus then, and the
    precision each trained in (a random-init row trains nothing: —)."""
    lines = ["| row | data | phase | variant | seed | 20-NN top-1 (%): then, now | now minus then "
             "| linear top-1 (%): then, now | now minus then | precision: then, now | logged again "
             "(UTC) |",
             "|---" * 11 + "|"]
    for old, new in pairs:
        cells = []
        for key in ("knn_top1", "linear_top1"):
            then, now = old.get(key), new.get(key)
            cells += [f"{then:.2f}, {now:.2f}",
                      f"{now - then:+.2f}"] if None not in (then, now) else ["—", "—"]
        precision = ("—" if new.get("random_init")
                     else f"{old.get('precision', 'not logged')}, {new.get('precision')}")
        lines.append(f"| {new['row']} | {new['data']} | {new['phase']} | {new['variant']} | "
                     f"{new['seed']} | "
                     + " | ".join(cells) + f" | {precision} | {logged_dates([new])} |")
    return "\n".join(lines) if pairs else ("No line logged without a timestamp has been run again "
                                           "yet (`python extras/experiments/compare.py --relog "
                                           "...`).")


def network_of(record, records):
    """The network a logged row evaluated: its logged signature, else (lines logged before
    signatures) that of its training command, built; a random-init row's is its source row's."""
    if "network" in record:
        return record["network"]
    if record.get("random_init"):
        key = (record["data"], RANDOM_ROWS[record["row"]], record["variant"], record["phase"],
               record["seed"])
        source = next((r for r in records if log_key(r) == key), None)
        if source is None:
            sys.exit(f"error: {record['row']} seed {record['seed']} logs no network and its source "
                     f"row {key[1]} is not logged: which network it evaluated is unknown")
        return network_of(source, records)
    return json.loads(provenance.command_signature(record["commands"][0]))


def baselines(records, data, phase):
    """{(random-init row, seed): its first record} of one comparison, any variant (the
    initialisation depends on the network and the seed only)."""
    found = {}
    for r in records:
        if r.get("random_init") and (r["data"], r["phase"]) == (data, phase):
            found.setdefault((r["row"], r["seed"]), r)
    return found


def gains(rs, base, records, key="knn_top1"):
    """rs[i][key] minus that of its own network's random init, seed by seed; None unless every
    record has one. Exits with one line if a pair would be two different networks."""
    out = []
    for r in rs:
        b = base.get((baseline_row(r["row"]), r["seed"]))
        if b is None or r.get(key) is None or b.get(key) is None:
            return None
        mine, theirs = network_of(r, records), network_of(b, records)
        if mine != theirs:
            sys.exit(f"error: {r['row']} ({r['variant']}, seed {r['seed']}) cannot be paired with "
                     f"{b['row']}: another network ({mine['arch']} {mine['image_token']} "
                     f"{mine['keys_sha256']} vs {theirs['arch']} {theirs['image_token']} "
                     f"{theirs['keys_sha256']}); log its own random-init row")
        out.append(r[key] - b[key])
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


def comparison_table(records, data, phase):
    """The markdown table of one comparison: a line per (variant, row) in the order the log first
    holds the variants and ROWS' order within one."""
    lines = ["| row | variant | steps | seeds | 20-NN top-1 (%) | 20-NN gain | linear top-1 (%) | "
             "linear gain | "
             "flip: top-10 / all-token acc. (%) | overlap: all-token acc. (%) | h / ln K | "
             "h̄ / ln K | "
             "train time (min) | peak memory (MB) | logged (UTC) |", "|---" * 15 + "|"]
    chosen = [r for r in records if r["data"] == data and r["phase"] == phase]
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
                lines.append(pixels + " — |" * 9 + f" {logged_dates(rs)} |")
                continue
            steps = "—" if row in RANDOM_ROWS else "/".join(sorted({str(r["steps"]) for r in rs}))
            chosen = phase == "val" or row in RANDOM_ROWS or validated(records, row, variant)
            shown = variant if chosen else f"{variant} (test only)"
            knn_gain, linear_gain = ((None, None) if row in RANDOM_ROWS else
                                     (gains(rs, base, records),
                                      gains(rs, base, records, "linear_top1")))
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
                         f"| {logged_dates(rs)} |")
    if len(lines) == 2:
        return f"No {phase}-phase run of the comparison on {data} is logged yet."
    return "\n".join(lines)


def summary_table(records, data="fashion_mnist", phase="test", variant="recipe"):
    """The README's glance at the comparison: per backbone, the random-init 20-NN of DINO's network
    and each method's 20-NN with its gain over its own network at random init (a row whose network
    is not DINO's names its own random init), mean ± half-range over the seeds logged for both."""
    chosen = [r for r in records if (r["data"], r["phase"],
                                     r["variant"]) == (data, phase, variant) and "backbone" in r]
    base = baselines(records, data, phase)
    lines = ["| backbone | random init | " + " | ".join(SUMMARY_COLUMNS) + " |",
             "|---|---|" + "---|" * len(SUMMARY_COLUMNS)]
    for backbone, flags in BACKBONES.items():
        seeds = sorted(seed for row, seed in base if row == f"{backbone}_random")
        if not seeds:
            continue
        cells = [cell([base[(f"{backbone}_random", seed)]["knn_top1"] for seed in seeds])]
        for rows in SUMMARY_COLUMNS.values():
            if backbone not in rows:
                cells.append("n/a")
                continue
            rs = [r for r in chosen if r["row"] == rows[backbone]]
            gain = gains(rs, base, records) if rs else None
            own = baseline_row(rows[backbone])
            note = (" over its own random init "
                    f"{cell([base[(own, r['seed'])]['knn_top1'] for r in rs])}"
                    if gain and own != f"{backbone}_random" else "")
            untried = "" if validated(records, rows[backbone],
                                      variant) else ", not run on validation"
            cells.append(f"{cell([r['knn_top1'] for r in rs])} ({signed(gain)}{note}{untried})"
                         if gain else "—")
        lines.append(f"| `{flags.split()[1]}` | " + " | ".join(cells) + " |")
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
            mine = gains(rs, base, records, key)
            theirs = gains([dino[r["seed"]] for r in rs], base, records, key)
            found[row][1][key] = (mine, [a - b for a,
                                         b in zip(mine, theirs)] if mine and theirs else None)
    return found


def differences_table(records, data="fashion_mnist", runs=(("test", "recipe"),)):
    """What a method adds over DINO on the same backbone, 20-NN and linear probe, seed by seed, for
    each (phase, variant) of `runs` (a phase and a variant column when there are several)."""
    several = len(runs) > 1
    lines = ["| backbone | row | " + ("phase | variant | " if several else "")
             + "seeds | 20-NN gain | minus DINO's (seed 0, 1, ...) | linear gain | minus DINO's "
             "(seed 0, 1, ...) |",
             "|---" * (7 + 2 * several) + "|"]
    for phase, variant in runs:
        for row, (seeds, by_key) in differences(records, data, phase, variant).items():
            cells = []
            for mine, diffs in by_key.values():
                each = f" ({', '.join(f'{d:+.1f}' for d in diffs)})" if diffs else ""
                cells += [signed(mine), signed(diffs) + each]
            chosen = phase == "val" or validated(records, row, variant)
            marked = variant if chosen else f"{variant} (test only)"
            run = f"{phase} | {marked} | " if several else ""
            lines.append(f"| `{BACKBONES[METHOD_FLAGS[row][0]].split()[1]}` | {row} | {run}{seeds} "
                         "| "
                         + " | ".join(cells) + " |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No method row with its DINO row on {data} is logged yet.")


def long_runs(records, data="fashion_mnist"):
    """(phase, variant) of every comparison run longer than the shared 400 steps, validation
    first."""
    return sorted({(r["phase"],
                    r["variant"]) for r in records if r["data"] == data and r["steps"] > 400},
                  key=lambda run: (run[0] != "val", run[1]))


def added_table(records):
    """The README's glance at differences_table: per backbone and method, its 20-NN gain minus
    DINO's / its linear-probe gain minus DINO's."""
    found = differences(records)
    columns = [c for c in SUMMARY_COLUMNS if c != "DINO"]
    lines = ["| over DINO: 20-NN / linear | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for backbone, flags in BACKBONES.items():
        cells = [" / ".join(signed(found[rows[backbone]][1][k][1])
                            for k in ("knn_top1", "linear_top1"))
                 if backbone in rows and rows[backbone] in found
                 else "n/a" if backbone not in rows else "—"
                 for rows in (SUMMARY_COLUMNS[c] for c in columns)]
        lines.append(f"| `{flags.split()[1]}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_budget_table(records, data="fashion_mnist"):
    """The rows trained longer than the shared budget's 400 steps, validation first: 20-NN and its
    gain over the row's own random init, and the 20-NN minus the raw pixels' of the same split (the
    same k-NN on the pixels of the same 32 px evaluation transform), seed by seed."""
    lines = ["| row | phase | variant | steps | seeds | 20-NN top-1 (%) | 20-NN gain | minus raw "
             "pixels (seed 0, 1, ...) | linear top-1 (%) | logged (UTC) |", "|---" * 10 + "|"]
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
                         f"{signed(gains(rs, base, records))} | "
                         + (f"{signed(below)} ({', '.join(f'{d:+.2f}' for d in below)})"
                            if below else "—")
                         + f" | {cell([r.get('linear_top1') for r in rs])} | {logged_dates(rs)} |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No row longer than 400 steps on {data} is logged yet.")


def long_glance_table(records, data="fashion_mnist"):
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
             "raw pixels (seed 0, 1, ...) "
             "| train time (min): split, seed, threads |", "|---" * 7 + "|"]

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
                     + f" | {times or '—'} |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No row longer than 400 steps on {data} has run on both splits yet.")


def costs_table(records, data="fashion_mnist", phase="test"):
    """CPU seconds of every command of a row (cpu_seconds), mean over its seeds: training per step
    (start-up included), each evaluation, each learning-curve point."""
    lines = ["| row | variant | seeds | training, per step | 20-NN | linear probe | correspondence "
             "+ collapse | each learning-curve point | logged (UTC) |", "|---" * 9 + "|"]
    groups = {}
    for r in records:
        if (r["data"], r["phase"]) == (data, phase) and "cpu_seconds" in r:
            groups.setdefault((r["row"], r["variant"]), []).append(r)

    def mean(rs, value):
        values = [value(r) for r in rs]
        return None if None in values else statistics.mean(values)

    for (row, variant), rs in groups.items():
        cpu = [r["cpu_seconds"] for r in rs]
        columns = [mean(rs, lambda r: r["cpu_seconds"]["train"] / r["steps"]
                        if "train" in r["cpu_seconds"] else None),
                   mean(rs, lambda r: r["cpu_seconds"].get("knn")),
                   mean(rs, lambda r: r["cpu_seconds"].get("linear")),
                   mean(rs, lambda r: r["cpu_seconds"].get("correspondence", 0)
                        + r["cpu_seconds"].get("teacher", 0)),
                   mean([r for r in rs if r.get("curve")],
                        lambda r: r["cpu_seconds"]["curve"] / len(r["curve"])
                        if "curve" in r["cpu_seconds"] else None)
                   if any(r.get("curve") for r in rs) else None]
        text = [f"{columns[0]:.2f} s" if columns[0] is not None else "—",
                *(f"{c:.0f} s" if c is not None else "—" for c in columns[1:])]
        lines.append(f"| `{row}` | {variant} | {len(cpu)} | " + " | ".join(text)
                     + f" | {logged_dates(rs)} |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No {phase}-phase row on {data} logs its CPU seconds yet.")


def kept_every(record):
    """The steps between the checkpoints a row's training kept (--curve_every): its curve's first
    step, else its training command's --saveckp_freq epochs of --max_steps_per_epoch steps."""
    if record.get("curve"):
        return record["curve"][0]["step"]
    command = " ".join(record.get("commands", [])[:1])
    found = [re.findall(rf"{flag} (\d+)", command)
             for flag in ("--saveckp_freq", "--max_steps_per_epoch")]
    return int(found[0][-1]) * int(found[1][-1]) if all(found) else None


def reproducing_commands(records, curve_every_default, curve_seeds_default):
    """One `python extras/experiments/compare.py ...` line per (data, phase, variant, steps,
    extra), rows and seeds together."""
    groups = {}
    for r in records:
        skip_linear = r["row"] != "pixels" and "linear_top1" not in r
        key = (r["data"], r["phase"], r["variant"], r["steps"], r.get("extra", ""), skip_linear)
        group = groups.setdefault(key, ([], set(), set(), set(), set()))
        rows, seeds, trained_seeds, curve_seeds, curve_every = group
        if r["row"] not in rows:
            rows.append(r["row"])
        seeds.add(r["seed"])
        if r["row"] in METHOD_FLAGS:
            trained_seeds.add(r["seed"])
        if r.get("curve"):                    # the seeds with a learning curve
            curve_seeds.add(r["seed"])
        if kept_every(r):
            curve_every.add(kept_every(r))
    lines = []
    for key, (rows, seeds, trained_seeds, curve_seeds, curve_every) in groups.items():
        data, phase, variant, steps, extra, skip_linear = key
        line = (f"python extras/experiments/compare.py --data {data} --phase {phase} "
                f"--steps {steps} --seeds {' '.join(map(str, sorted(seeds)))} "
                f"--rows {' '.join(rows)}")
        if curve_every and curve_every != {curve_every_default}:
            line += f" --curve_every {min(curve_every)}"
        if curve_seeds != trained_seeds & set(curve_seeds_default):
            line += " --curve_seeds" + "".join(f" {seed}" for seed in sorted(curve_seeds))
        if skip_linear:
            line += " --skip_linear"
        lines.append(line + results.variant_flags(variant, extra))
    return lines
