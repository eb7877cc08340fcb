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
    DEBIAN_FRONTEND=noninteractive retry apt-get install -y -qq "$@" >/dev/null
}

pip_install() {
    retry python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"
}
