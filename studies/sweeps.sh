# The one sweep loop of the study scripts (sourced, not run): `run_sweeps PREFIX SWEEP... [-- OVERRIDE...]` runs
# `run.py -m experiment=<PREFIX><SWEEP> OVERRIDE...` for each sweep in order, timing each; complete runs are
# skipped (resume=true), so a study script continues where it stopped. PY is the interpreter.
run_sweeps() {
    local prefix=$1 sweeps=() start
    shift
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
        sweeps+=("$1")
        shift
    done
    [ "$#" -gt 0 ] && shift  # the "--"
    for sweep in "${sweeps[@]}"; do
        start=$(date +%s)
        echo "== ${prefix}${sweep} ($(date -u +%H:%M:%S) UTC)"
        "$PY" run.py -m "experiment=${prefix}${sweep}" "$@"
        echo "== ${prefix}${sweep}: $(($(date +%s) - start)) s"
    done
}
