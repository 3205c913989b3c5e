#!/usr/bin/env bash
# Installs what areal-slurm's tests need (Debian/Ubuntu packages slurm-wlm and
# munge) where this machine allows it: as root with apt-get. Elsewhere it only
# warns and the Slurm tests skip with the reason, except under CI=true (CI
# has root and apt): there it exits 1, as the tests would fail.
set -u
ci() { [ "$(echo "${CI:-}" | tr '[:upper:]' '[:lower:]')" = true ]; }
PATH="$PATH:/usr/sbin:/sbin"
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    if ci; then
        echo "error: CI=true and Slurm (slurm-wlm, munge) is not installed, and this machine cannot install it (needs root and apt-get)" >&2
        exit 1
    fi
    echo "note: Slurm (slurm-wlm, munge) is not installed and this machine cannot install it (needs root and apt-get); the Slurm tests will be skipped" >&2
    exit 0
fi
echo "installing slurm-wlm and munge with apt-get (for areal-slurm's tests)"
export DEBIAN_FRONTEND=noninteractive
# The tests start their own daemons (private key, socket and ports); any the
# packages start system-wide are not used. Another apt-get (a fresh machine's
# own updates, or a second checkout's install) may hold dpkg's lock: wait for
# it instead of failing at once.
LOCK_WAIT=(-o DPkg::Lock::Timeout=600)
install() { apt-get "${LOCK_WAIT[@]}" install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
if ! install && ! { apt-get "${LOCK_WAIT[@]}" update -q >/dev/null && install; }; then
    if ci; then
        echo "error: CI=true and apt-get could not install slurm-wlm and munge" >&2
        exit 1
    fi
    echo "warning: apt-get could not install slurm-wlm and munge; the Slurm tests will skip" >&2
fi
exit 0
