#!/usr/bin/env bash
# gpu_check.sh's `ncu` part: Nsight Compute over scripts/ncu_targets.py, in the order that loses the least when the
# call's time runs out: the Hopper flash attention kernels beside torch's cuDNN backend ("sm90", what training runs on
# an H100/H200), then one bf16 training step (speed of light, launch and occupancy only; about 320 kernels), then the
# step's memory-bound ops alone at B 64 ("ops"), then the other flash kernel choices beside torch's flash backend
# ("flash"); all but the step with the full set of sections (the flash ones at GPT-2's attention shape). Each report
# is imported as CSV as soon as it is made (every metric; the same with the NVTX labels as kernel names; ncu's own
# findings; for all but the step, per SASS instruction and per .cu line, executions and sampled stalls);
# scripts/ncu_summary.py's tables go into OUT/ncu.log, the rest into OUT/ncu.tgz and OUT/ncu_sass.tgz. The reports
# themselves are dropped: the sessions that tune the kernels have no ncu to open them, and they are large. Prints
# one line for gpu_check's table: ok, or what failed.
# The 2026-11-26 H200 run (the old order: flash, sm90, step; `diagnose ncu` in 550 s) ran out of time after the sm90
# report: no SASS pages for the Hopper kernels, and the step's report killed by its timeout after nine passes (give
# `ncu` a call of its own).
# The 2026-11-27 H200 run (`ncu` alone, CALL_BUDGET=230) made the sm90 report and nothing after it: the step's was
# killed in its third pass. NCU_REPORTS="ops step" makes only those reports, in that order (a short call spends its
# seconds on what the last run did not reach).
# Usage: bash scripts/ncu_profile.sh OUT   (NCU=path overrides `ncu`; tests/test_ncu_summary.py passes a fake one;
# NCU_BUDGET=s cuts every step's timeout to what is left of that many seconds: gpu_check passes what its call has).
# `ncu_profile.sh --check` only checks NCU_REPORTS (gpu_check.sh, before its build: a misspelt name would cost a call).
set -uo pipefail
cd "$(dirname "$0")/.."
all_reports="sm90 step ops flash"
reports=$(echo ${NCU_REPORTS-$all_reports})  # one space between names
[ -n "$reports" ] || { echo "ncu_profile.sh: NCU_REPORTS is blank; leave it unset for every report" >&2; exit 2; }
for r in $reports; do
  [[ " $all_reports " == *" $r "* ]] || { echo "ncu_profile.sh: NCU_REPORTS names $r, not one of: $all_reports" >&2
                                         exit 2; }
done
[ "${1:-}" = --check ] && exit 0
out=${1:?usage: ncu_profile.sh OUT}
t0=$SECONDS budget=${NCU_BUDGET:-100000}
source scripts/budget.sh
ncu=${NCU:-ncu}
dir="$out/ncu"
mkdir -p "$dir"
# --clock-control none: the card's clocks as found (ncu would lock them to base for the run otherwise);
# --profile-from-start off: only the calls ncu_targets.py brackets with cudaProfilerStart/Stop (not warm-ups).
args=(--profile-from-start off --nvtx --clock-control none --import-source no -f)
status=  # "; "-separated findings, "ok" if none

# Report r's CSV pages (and for a flash report its source pages) from $dir/r.ncu-rep, which is then deleted.
import_report() {
  local r=$1 rep="$dir/$1.ncu-rep"
  [ -f "$rep" ] || { status="$status; no $r report"; return; }
  "$ncu" -i "$rep" --page raw --csv --print-units base > "$dir/$r-raw.csv" 2>&1
  "$ncu" -i "$rep" --page raw --csv --print-units base --print-nvtx-rename kernel > "$dir/$r-labels.csv" 2>&1
  "$ncu" -i "$rep" --page details --csv --print-units base > "$dir/$r-details.csv" 2>&1
  if [ "$r" != step ]; then
    # Per SASS instruction (--print-source is newer than --page source: without it, the page's default view), and
    # per .cu line (the build has -lineinfo; the sources are where the build left them, in this tree).
    timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv --print-source sass > "$dir/$r-sass.csv" 2>&1 ||
      timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv > "$dir/$r-sass.csv" 2>&1
    timeout $(tmo 120) "$ncu" -i "$rep" --page source --csv --print-source cuda > "$dir/$r-cuda.csv" 2>&1
  fi
  rm -f "$rep"
}

# Each report is a function, run in NCU_REPORTS' order. By default the Hopper kernels come first, in a report of their
# own (a trap or hang there cannot cost the others), and not at all when flash_diagnose, earlier in the same call,
# saw one of them crash or time out.
sm90_crashed=false
if [ -f "$out/diagnose.log" ] && grep -Eq "^== .*sm90.*: (CRASHED|TIMEOUT)" "$out/diagnose.log"; then
  sm90_crashed=true
fi
cudnn=--cudnn  # the cuDNN backend goes with the sm90 report, or with the flash report when there is none
if [[ " $reports " == *" sm90 "* ]] && ! $sm90_crashed; then cudnn=; fi
report_sm90() {
  if $sm90_crashed; then
    status="$status; sm90 not profiled (diagnose: a crash or timeout)"
    return
  fi
  timeout $(tmo 150) "$ncu" "${args[@]}" --set full -o "$dir/sm90" python3 scripts/ncu_targets.py sm90 \
    > "$dir/sm90.log" 2>&1 || status="$status; FAIL sm90 (rc $?)"
  import_report sm90
}
# The step's kernels with the GPT-2 model's gigabytes around them: kernel replay would save and restore that memory
# for each kernel's every pass; application replay runs the whole program once per pass instead (the same seed,
# the same kernels), one pass for each group of metrics (nine passes of 323 kernels did not finish in the 2026-11-26
# run's 200 s). Relaxed: a kernel that one pass does not match is left out, not the whole report.
report_step() {
  timeout $(tmo 300) "$ncu" "${args[@]}" --replay-mode application --app-replay-mode relaxed \
    --section SpeedOfLight --section LaunchStats --section Occupancy -o "$dir/step" \
    python3 scripts/ncu_targets.py step > "$dir/step.log" 2>&1 || status="$status; FAIL step (rc $?)"
  import_report step
}
# The step's memory-bound ops alone at its shapes (B 64), the full set with SASS pages: what the step's report
# cannot say (why the LayerNorm backward ran at 2.4 TB/s in the eighth run; scripts/ncu_targets.py).
report_ops() {
  timeout $(tmo 150) "$ncu" "${args[@]}" --set full -o "$dir/ops" python3 scripts/ncu_targets.py ops \
    > "$dir/ops.log" 2>&1 || status="$status; FAIL ops (rc $?)"
  import_report ops
}
report_flash() {
  timeout $(tmo 240) "$ncu" "${args[@]}" --set full -o "$dir/flash" python3 scripts/ncu_targets.py flash $cudnn \
    > "$dir/flash.log" 2>&1 || status="$status; FAIL flash (rc $?)"
  import_report flash
}
for r in $reports; do "report_$r"; done
{
  for r in sm90 ops flash; do
    [ -f "$dir/$r-raw.csv" ] || continue
    python3 scripts/ncu_summary.py "$dir/$r-raw.csv" --labels "$dir/$r-labels.csv" --json "$dir/$r-summary.json"
    echo
  done
  [ -f "$dir/step-raw.csv" ] &&
    python3 scripts/ncu_summary.py "$dir/step-raw.csv" --group --top 20 --json "$dir/step-summary.json"
} > "$out/ncu.log" 2>&1
# The source pages in an archive of their own: if they pass the device call's 16 MB a file, the rest still comes
# back.
(cd "$dir" && ls -- *-sass.csv *-cuda.csv 2>/dev/null | xargs -r tar -czf ../ncu_sass.tgz --remove-files)
tar -czf "$out/ncu.tgz" -C "$out" ncu && rm -rf "$dir"
echo "${status:-ok}" | sed 's/^; //'
