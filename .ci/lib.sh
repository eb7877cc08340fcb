# Shared by .ci/run and .ci/fuzz: installs that survive a package registry's hiccup on a fresh
# machine (three tries, 10 and 20 s apart) instead of failing the run.

retry() {
    for attempt in 1 2; do
        "$@" && return 0
        echo "attempt $attempt of: $* failed; retrying in $((attempt * 10)) s" >&2
        sleep $((attempt * 10))
    done
    "$@"
}

apt_install() {
    retry apt-get update -qq
    apt_get_install "$@"
}

# An install on package lists already refreshed.
apt_get_install() {
    DEBIAN_FRONTEND=noninteractive retry apt-get install -y -qq "$@" >/dev/null
}

pip_install() {
    retry python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"
}

# Step timings for ci_summary: `step NAME` ends the step before it.
ci_steps=()
ci_step_name=""
ci_step_started=$SECONDS
step() {
    if [ -n "$ci_step_name" ]; then
        ci_steps+=("$(printf '%6d s  %s' $((SECONDS - ci_step_started)) "$ci_step_name")")
    fi
    ci_step_name=$1
    ci_step_started=$SECONDS
}

# The test logs ci_summary searches for failures.
ci_test_logs=()

# What a reader of the log's tail needs: how long each step took, and each failed test with the
# message it panicked with (its full output is further up the log).
ci_summary() {
    local rc=$?
    step ""
    echo
    echo "== CI summary: exit $rc after $SECONDS s"
    printf '%s\n' "${ci_steps[@]}"
    local log
    for log in "${ci_test_logs[@]}"; do
        [ -s "$log" ] || continue
        grep -E '^test .* \.\.\. FAILED$|^error: .*target.* failed|^    `-p ' "$log" || true
        awk '/^---- .* stdout ----$/ { name = $2 }
             /^thread .* panicked at / { shown = 1; lines = 0; print "  " name ": " $0; next }
             shown { if ($0 ~ /^(stack backtrace:|note: )/ || $0 == "" || lines >= 6) shown = 0;
                     else { print "    " $0; lines++ } }' "$log"
    done
}
