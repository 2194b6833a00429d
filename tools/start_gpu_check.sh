#!/usr/bin/env bash
# Engine start on the GPU, in one device call (about a minute on an H100 or H200): the sweep's `start` target, the
# SDAR-1.7B geometry with random weights and default settings built in fresh processes, `cold` with empty Triton
# and Inductor caches, then `warm` with what the cold run left there. Prints each run's phases (they cover the
# whole Diffulex(...) call), what the build's dry pass recorded and the helper processes compiled, or that the
# build's manifest let it skip the dry pass (the `kernels:` log lines), and the targets (ready <= 30 s cold,
# <= 15 s warm). The dry pass's own tests on tiny CUDA engines are part of tools/gpu_tests.sh.
# Usage (GPU machine, repository root): tools/start_gpu_check.sh OUT_DIR
# Writes OUT_DIR/start/start.json, OUT_DIR/start/tables.md and OUT_DIR/start/dry_pass.json; exits non-zero when an
# engine did not start, or when a dry warm-up read device data back (DryPassReadError: that warm-up must be kept
# out of the dry pass) or failed otherwise.
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
kernels = {r["case"]: [line for line in r.get("build_log", []) if line.startswith("kernels:")] for r in rows}
dry_failed = {case: lines for case, lines in kernels.items()
              if any("left to the build" in line or "failed" in line for line in lines)}
with open(sys.argv[1].replace("start.json", "dry_pass.json"), "w") as out:
    json.dump({"kernels_log": kernels, "dry_pass_failed": dry_failed}, out, indent=1)
for case, lines in kernels.items():
    if not lines:
        print(f"{case}: no 'kernels:' line: the helper processes did not run (no spare cores or no jit_cache_hook?)")
for case, lines in dry_failed.items():
    print(f"start_gpu_check: {case}: a dry warm-up or a helper failed (only time lost, but it must be fixed): "
          + " | ".join(lines))
if failed:
    sys.exit("start_gpu_check: an engine did not start")
sys.exit("start_gpu_check: the dry pass or a helper failed" if dry_failed else 0)
PY
