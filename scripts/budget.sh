# Sourced by gpu_check.sh and ncu_profile.sh: a device call has 600 s, and a step that runs past it loses what comes
# after (the table, the evidence archive). The caller sets t0=$SECONDS and budget (seconds); `tmo N` is a step's
# timeout: N, or what is left of the budget if less (at least 1).
tmo() { local left=$((budget - (SECONDS - t0))); [ $left -lt $1 ] && echo $((left > 1 ? left : 1)) || echo $1; }
