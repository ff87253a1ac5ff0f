#!/usr/bin/env python3
"""The table of scripts/hooks_testbed.sh from its $OUT: medians over the repeats, exposed ms,
the bytes on the wire from the first repeat's auto profile, and the points that failed.

    scripts/hooks_table.py OUT
"""
import csv, glob, json, os, re, statistics, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(os.path.join(out, "raw.csv"))))
failed = []
if os.path.exists(os.path.join(out, "failed.csv")):
    failed = list(csv.DictReader(open(os.path.join(out, "failed.csv"))))
ms = {}
for r in rows:
    ms.setdefault((r["rate"], r["shape"], r["system"], r["hook"]), []).append(float(r["ms_step"]))
def wire(rate, shape):
    """bytes per step and rank for each (system, hook), from auto's profile"""
    path = os.path.join(out, f"profile_{rate}_{shape}_r1.json")
    if not os.path.exists(path):
        return {}
    p = json.load(open(path))
    shapes, params = p["compression"]["shapes"], p["params"]
    rate_min = p["compression"]["min_compression_rate"]
    total = sum(q["Len"] for q in params) * 4
    w = {("goddp", "none"): total, ("torch", "none"): total, ("goddp", "bf16"): total // 2,
         ("goddp", "fp16"): total // 2, ("torch", "fp16"): total // 2}
    for r in (1, 2, 4):
        ours = theirs = 0.0
        for q, s in zip(params, shapes):
            n = s[0] if s and len(s) >= 2 else 0
            m = q["Len"] // n if n else 0
            if n and (n + m) * r * rate_min < n * m:
                ours += 4 * (n + m) * r / 2
                theirs += 4 * (n + m) * r
            else:
                ours += 4 * q["Len"]
                theirs += 4 * q["Len"]
        w[("goddp", f"powersgd_r{r}")] = int(ours)
        w[("torch", f"powersgd_r{r}")] = int(theirs)
    txt = os.path.join(out, f"profile_{rate}_{shape}_r1.ddpsim.txt")
    if os.path.exists(txt):
        for line in open(txt):
            mm = re.match(r"\| auto: (.*?) \| [0-9.]+ \| [0-9.]+ \| ([0-9]+) \|", line)
            if mm:
                w[("goddp", "auto")] = int(mm.group(2))
    return w
with open(os.path.join(out, "table.md"), "w") as f:
    for rate, shape in sorted({(r["rate"], r["shape"]) for r in rows}):
        w = wire(rate, shape)
        f.write(f"\n### {rate}, {shape} (layers x hidden)\n\n")
        f.write("| system | hook | ms/step (median) | runs | exposed ms | bytes per step on the wire | vs compute alone |\n|---|---|---:|---|---:|---:|---:|\n")
        for sysname in ("goddp", "torch"):
            comp = statistics.median(ms.get((rate, shape, sysname, "compute"), [float("nan")]))
            for hook in ("compute", "none", "bf16", "fp16", "powersgd_r1", "powersgd_r2", "powersgd_r4", "auto"):
                xs = ms.get((rate, shape, sysname, hook))
                if not xs:
                    continue
                med = statistics.median(xs)
                exp = "" if hook == "compute" else f"{med - comp:.1f}"
                b = w.get((sysname, hook), "")
                runs = " / ".join(f"{x:.1f}" for x in xs)
                f.write(f"| {sysname} | {hook} | {med:.1f} | {runs} | {exp} | {b} | {med / comp:.2f} |\n")
        for r in failed:
            if (r["rate"], r["shape"]) == (rate, shape):
                f.write(f"\n{r['system']} {r['hook']} repeat {r['repeat']} failed: {r['error']}\n")
        for path in sorted(glob.glob(os.path.join(out, "logs", f"{rate}_{shape}_goddp_auto_r*.log"))):
            for line in open(path):
                if "auto hook after" in line:
                    f.write(f"\n{os.path.basename(path)}: {line.strip()}\n")
print(open(os.path.join(out, "table.md")).read())
