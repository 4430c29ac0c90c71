#!/usr/bin/env bash
# gpu_check.sh's `ncu` part: Nsight Compute over scripts/ncu_targets.py, every flash attention kernel choice at
# GPT-2's attention shape with the full set of sections, then one bf16 training step with speed of light, launch and
# occupancy only (about 400 kernels); the reports imported as CSV (every metric; the same with the NVTX labels as
# kernel names; ncu's own findings; per SASS instruction and per .cu line, executions and sampled stalls);
# scripts/ncu_summary.py's tables into OUT/ncu.log, the rest into OUT/ncu.tgz and OUT/ncu_sass.tgz. The reports
# themselves are dropped: the sessions that tune the kernels have no ncu to open them, and they are large. Prints
# one line for gpu_check's table: ok, or what failed.
# Usage: bash scripts/ncu_profile.sh OUT   (NCU=path overrides `ncu`; tests/test_ncu_summary.py passes a fake one)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: ncu_profile.sh OUT}
ncu=${NCU:-ncu}
dir="$out/ncu"
mkdir -p "$dir"
# --clock-control none: the card's clocks as found (ncu would lock them to base for the run otherwise);
# --profile-from-start off: only the calls ncu_targets.py brackets with cudaProfilerStart/Stop (not warm-ups).
args=(--profile-from-start off --nvtx --clock-control none --import-source no -f)
status=ok
timeout 300 "$ncu" "${args[@]}" --set full -o "$dir/flash" python3 scripts/ncu_targets.py flash \
  > "$dir/flash.log" 2>&1 || status="FAIL flash (rc $?)"
# The step's ~400 kernels with the GPT-2 model's gigabytes around them: kernel replay would save and restore that
# memory for each kernel's every pass; application replay runs the whole program once per pass instead (the same
# seed, the same kernels).
timeout 200 "$ncu" "${args[@]}" --replay-mode application --section SpeedOfLight --section LaunchStats \
  --section Occupancy -o "$dir/step" python3 scripts/ncu_targets.py step > "$dir/step.log" 2>&1 ||
  status="$status; FAIL step (rc $?)"
for r in flash step; do
  rep="$dir/$r.ncu-rep"
  [ -f "$rep" ] || { status="$status; no $r report"; continue; }
  "$ncu" -i "$rep" --page raw --csv --print-units base > "$dir/$r-raw.csv" 2>&1
  "$ncu" -i "$rep" --page raw --csv --print-units base --print-nvtx-rename kernel > "$dir/$r-labels.csv" 2>&1
  "$ncu" -i "$rep" --page details --csv --print-units base > "$dir/$r-details.csv" 2>&1
done
if [ -f "$dir/flash.ncu-rep" ]; then
  # (--print-source is newer than --page source: without it, the page's default view)
  timeout 120 "$ncu" -i "$dir/flash.ncu-rep" --page source --csv --print-source sass > "$dir/flash-sass.csv" 2>&1 ||
    timeout 120 "$ncu" -i "$dir/flash.ncu-rep" --page source --csv > "$dir/flash-sass.csv" 2>&1
  # The same per .cu line (the build has -lineinfo; the sources are where the build left them, in this tree).
  timeout 120 "$ncu" -i "$dir/flash.ncu-rep" --page source --csv --print-source cuda > "$dir/flash-cuda.csv" 2>&1
fi
{
  python3 scripts/ncu_summary.py "$dir/flash-raw.csv" --labels "$dir/flash-labels.csv" --json "$dir/flash-summary.json"
  echo
  python3 scripts/ncu_summary.py "$dir/step-raw.csv" --group --top 20 --json "$dir/step-summary.json"
} > "$out/ncu.log" 2>&1
rm -f "$dir"/*.ncu-rep
# The SASS pages in an archive of their own: if they pass the device call's 16 MB a file, the rest still comes back.
if [ -f "$dir/flash-sass.csv" ]; then
  tar -czf "$out/ncu_sass.tgz" -C "$dir" flash-sass.csv flash-cuda.csv && rm "$dir"/flash-sass.csv "$dir"/flash-cuda.csv
fi
tar -czf "$out/ncu.tgz" -C "$out" ncu && rm -rf "$dir"
echo "$status"
