"""The detail tables of the comparison in the generated appendix (docs/APPENDIX.md): the cost of a
row, the commands that reproduce every row, and DINO's four k (every line that logged the k-NN at
k = 10, 20, 100 and 200, and each trained row against the raw pixels at the same k, with the
findings rule of claims.py). Not a script."""
import re
import statistics

import claims
import provenance
import results
from compare_tables import IMAGES, METHOD_FLAGS, RANDOM_ROWS, logged_dates, signed


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


# ------------------------------------------------------------------------------------------------
# DINO's four k: every line that logged the k-NN at k = 10, 20, 100 and 200, against the pixels
# ------------------------------------------------------------------------------------------------
KS = ("10", "20", "100", "200")


def knn_k_table(records):
    """The lines that logged the k-NN at DINO's four k (`knn_top1_by_k`), one per line."""
    lines = ["| row | data | phase | steps | seed | " + " | ".join(f"{k}-NN top-1 (%)" for k in KS)
             + " | logged (UTC) |", "|---" * (6 + len(KS)) + "|"]
    for r in records:
        if isinstance(r.get("knn_top1_by_k"), dict):
            values = [r["knn_top1_by_k"].get(k) for k in KS]
            cells = [f"{v:.2f}" if provenance.is_number(v) else "—" for v in values]
            steps = "—" if r["row"] == "pixels" or r["row"] in RANDOM_ROWS else r["steps"]
            lines.append(f"| {r['row']} | {r['data']} | {r['phase']} | {steps} | {r['seed']} | "
                         + " | ".join(cells) + f" | {provenance.when(r)} |")
    return "\n".join(lines) if len(lines) > 2 else "No line holds the k-NN at four k yet."


def all_four_k(record):
    """Whether the line holds a number at each of the four k (a line without them is no row of
    the differences, rather than a KeyError)."""
    by_k = record.get("knn_top1_by_k")
    return isinstance(by_k, dict) and all(provenance.is_number(by_k.get(k)) for k in KS)


def knn_k_pixels_table(records, data="fashion_mnist", phase="test"):
    """Each trained row's k-NN minus the raw pixels' at the same k (same split, same vote), seed by
    seed from unrounded values, and whether the difference is a finding (claims.finding: beyond the
    seeds' spread and one evaluation's binomial error)."""
    by_k = [r for r in records if (r["data"], r["phase"]) == (data, phase) and all_four_k(r)]
    pixels = next((r["knn_top1_by_k"] for r in by_k if r["row"] == "pixels"), None)
    groups = {}
    for r in sorted(by_k, key=lambda r: (r["steps"], r["row"], r["seed"])):
        if r["row"] in METHOD_FLAGS and pixels:      # a variant is a setting of its own
            groups.setdefault((r["row"], r["variant"], r["steps"]), []).append(r["knn_top1_by_k"])
    header = " | ".join(f"{k}-NN minus pixels (seed 0, 1, ...)" for k in KS)
    lines = [f"| row | variant | steps | seeds | {header} |", "|---" * 8 + "|"]
    for (row, variant, steps), seeds in groups.items():
        cells = []
        for k in KS:
            diffs = [values[k] - pixels[k] for values in seeds]
            error = claims.binomial_error([v[k] for v in seeds] + [pixels[k]], IMAGES[data])
            verdict = claims.finding(diffs, error) if len(diffs) > 1 else "one seed"
            cells.append(f"{signed(diffs)} ({', '.join(f'{d:+.2f}' for d in diffs)}): {verdict}")
        lines.append(f"| {row} | {variant} | {steps} | {len(seeds)} | " + " | ".join(cells) + " |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No trained row on {data}'s {phase} split holds the k-NN at four k yet.")
