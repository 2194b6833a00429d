#!/usr/bin/env bash
# Engine start on the GPU, in one device call (about 2 minutes on an H100 or H200): the sweep's `start` target, the
# SDAR-1.7B geometry with random weights and default settings built in fresh processes, `cold` with empty Triton
# and Inductor caches, then `warm` with what the cold run left there. Prints each run's phases (they cover the
# whole Diffulex(...) call), where the attention kernels were compiled, and the targets
# (ready <= 30 s cold, <= 15 s warm).
# Usage (GPU machine, repository root): tools/start_gpu_check.sh OUT_DIR
# Writes OUT_DIR/start/start.json and OUT_DIR/start/tables.md; exits non-zero when an engine did not start.
set -euo pipefail
out=${1:?usage: tools/start_gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'start_gpu_check: no CUDA device')"
nvidia-smi --query-gpu=name --format=csv,noheader
python -m diffulex.cli bench sweep --targets start --out "$out/start"
python - "$out/start/start.json" <<'PY'
import json
import sys

TARGET_S = {"cold": 30.0, "warm": 15.0}
rows = json.load(open(sys.argv[1]))["rows"]
failed = [r for r in rows if r.get("error") or r.get("skipped")]
for r in rows:
    if r in failed:
        print(f"{r['case']}: {r.get('error') or r.get('skipped')}")
        continue
    phases = sum(r["build_phases_s"].values())
    met = "met" if r["ready_s"] <= TARGET_S[r["case"]] else "MISSED"
    print(f"{r['case']}: ready {r['ready_s']:.1f} s (target {TARGET_S[r['case']]:.0f} s: {met}) = imports "
          f"{r['imports_s']:.1f} + build {r['build_s']:.2f} (phases {phases:.2f}, outside them "
          f"{r['build_s'] - phases:.2f}); first request {r['first_request_s']:.2f} s")
    for name, seconds in sorted(r["build_phases_s"].items(), key=lambda item: -item[1]):
        print(f"    {seconds:7.2f} s  {name}")
    for line in r["build_log"]:
        if not line.startswith("engine ready in"):
            print(f"    log: {line}")
sys.exit("start_gpu_check: an engine did not start" if failed else 0)
PY
