#!/usr/bin/env bash
# gpu_check.sh's `ncu` part: Nsight Compute over scripts/ncu_targets.py, every flash attention kernel choice at
# GPT-2's attention shape with the full set of sections, then one bf16 training step with speed of light, launch and
# occupancy only (about 400 kernels); the reports imported as CSV (every metric; the same with the NVTX labels as
# kernel names; ncu's own findings; per SASS instruction and per .cu line, executions and sampled stalls);
# scripts/ncu_summary.py's tables into OUT/ncu.log, the rest into OUT/ncu.tgz and OUT/ncu_sass.tgz. The reports
# themselves are dropped: the sessions that tune the kernels have no ncu to open them, and they are large. Prints
# one line for gpu_check's table: ok, or what failed.
# Usage: bash scripts/ncu_profile.sh OUT   (NCU=path overrides `ncu`; tests/test_ncu_summary.py passes a fake one;
# NCU_BUDGET=s cuts every step's timeout to what is left of that many seconds: gpu_check passes what its call has)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: ncu_profile.sh OUT}
t0=$SECONDS budget=${NCU_BUDGET:-100000}
source scripts/budget.sh
ncu=${NCU:-ncu}
dir="$out/ncu"
mkdir -p "$dir"
# --clock-control none: the card's clocks as found (ncu would lock them to base for the run otherwise);
# --profile-from-start off: only the calls ncu_targets.py brackets with cudaProfilerStart/Stop (not warm-ups).
args=(--profile-from-start off --nvtx --clock-control none --import-source no -f)
status=ok skip=
timeout $(tmo 240) "$ncu" "${args[@]}" --set full -o "$dir/flash" python3 scripts/ncu_targets.py flash \
  > "$dir/flash.log" 2>&1 || status="FAIL flash (rc $?)"
# The Hopper kernels in a report of their own (a trap or hang there cannot cost the one above), and not at all when
# flash_diagnose, earlier in the same call, saw one of them crash or time out.
if [ -f "$out/diagnose.log" ] && grep -Eq "^== .*sm90.*: (CRASHED|TIMEOUT)" "$out/diagnose.log"; then
  status="$status; sm90 not profiled (diagnose: a crash or timeout)"
  skip=sm90
else
  timeout $(tmo 150) "$ncu" "${args[@]}" --set full -o "$dir/sm90" python3 scripts/ncu_targets.py sm90 \
    > "$dir/sm90.log" 2>&1 || status="$status; FAIL sm90 (rc $?)"
fi
# The step's ~400 kernels with the GPT-2 model's gigabytes around them: kernel replay would save and restore that
# memory for each kernel's every pass; application replay runs the whole program once per pass instead (the same
# seed, the same kernels).
timeout $(tmo 200) "$ncu" "${args[@]}" --replay-mode application --section SpeedOfLight --section LaunchStats \
  --section Occupancy -o "$dir/step" python3 scripts/ncu_targets.py step > "$dir/step.log" 2>&1 ||
  status="$status; FAIL step (rc $?)"
for r in flash sm90 step; do
  rep="$dir/$r.ncu-rep"
  [ $r = "$skip" ] && continue
  [ -f "$rep" ] || { status="$status; no $r report"; continue; }
  "$ncu" -i "$rep" --page raw --csv --print-units base > "$dir/$r-raw.csv" 2>&1
  "$ncu" -i "$rep" --page raw --csv --print-units base --print-nvtx-rename kernel > "$dir/$r-labels.csv" 2>&1
  "$ncu" -i "$rep" --page details --csv --print-units base > "$dir/$r-details.csv" 2>&1
  [ $r = step ] && continue
  # Per SASS instruction (--print-source is newer than --page source: without it, the page's default view), and per
  # .cu line (the build has -lineinfo; the sources are where the build left them, in this tree).
  timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv --print-source sass > "$dir/$r-sass.csv" 2>&1 ||
    timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv > "$dir/$r-sass.csv" 2>&1
  timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv --print-source cuda > "$dir/$r-cuda.csv" 2>&1
done
{
  for r in flash sm90; do
    [ -f "$dir/$r-raw.csv" ] || continue
    python3 scripts/ncu_summary.py "$dir/$r-raw.csv" --labels "$dir/$r-labels.csv" --json "$dir/$r-summary.json"
    echo
  done
  python3 scripts/ncu_summary.py "$dir/step-raw.csv" --group --top 20 --json "$dir/step-summary.json"
} > "$out/ncu.log" 2>&1
rm -f "$dir"/*.ncu-rep
# The source pages in an archive of their own: if they pass the device call's 16 MB a file, the rest still comes
# back.
(cd "$dir" && ls -- *-sass.csv *-cuda.csv 2>/dev/null | xargs -r tar -czf ../ncu_sass.tgz --remove-files)
tar -czf "$out/ncu.tgz" -C "$out" ncu && rm -rf "$dir"
echo "$status"
