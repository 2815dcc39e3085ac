#!/usr/bin/env python3
"""GPU time per kernel of the last decode step of each mode, and of a 512-token prefill, from
`ncu --csv` over `bench-coldstart gpu --profile --steps 1` (scripts/gpu-check.sh runs both).

That run makes, per mode (matrix-vector kernel, then cuBLAS), four forward passes — a prefill
and three decode steps — each beginning with the `embed` kernel, then one 512-token prefill;
the fourth pass of each mode and the last pass are summarized: kernels grouped by name, their
summed device time, and the pass's total (ncu serializes kernels, so launch gaps are not in it:
compare with the measured step time)."""
import csv
import sys
from collections import OrderedDict

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}

rows = []
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    us = float(r["Metric Value"].replace(",", "")) * SCALE.get(r["Metric Unit"], 1.0)
    rows.append((r["Kernel Name"], us))

passes, cur = [], None
for name, us in rows:
    if name.startswith("embed"):
        cur = []
        passes.append(cur)
    if cur is not None:
        cur.append((name, us))
print(f"{len(rows)} kernels profiled, {len(passes)} forward passes")
for label, idx in (("gemv: one decode step, batch 1", 3), ("cuBLAS: one decode step, batch 1", 7),
                   ("prefill of 512 tokens", 8)):
    if idx >= len(passes):
        print(f"{label}: pass {idx} missing")
        continue
    groups = OrderedDict()
    for name, us in passes[idx]:
        key = name[:60]
        n, t = groups.get(key, (0, 0.0))
        groups[key] = (n + 1, t + us)
    total = sum(t for _, t in groups.values())
    print(f"-- {label}: {len(passes[idx])} kernels, {total / 1e3:.2f} ms of GPU time")
    for key, (n, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"   {t / 1e3:7.3f} ms  {n:4d}×  {key}")
