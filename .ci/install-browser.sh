#!/usr/bin/env bash
# Debian's chromium and chromium-driver, for tests/notebooks/test_jupyterlab_browser.py (Selenium drives them
# through /usr/bin/chromedriver; no browser is downloaded). Idempotent: does nothing when both are installed.
# Without apt (another distribution, no root) or when apt fails, it says so and exits 0: the browser test then
# skips with its reason.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  echo "install-browser: chromium and chromedriver already installed ($(/usr/bin/chromium --version 2>/dev/null || true))"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-browser: no apt-get here; install chromium and its chromedriver by hand to run the browser test"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=sudo
  else
    echo "install-browser: apt-get needs root (and sudo is not available without a password); the browser test will skip"
    exit 0
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
# apt's and dpkg's progress ("Setting up ...", triggers, alternatives: hundreds of lines) goes to a log that is shown
# only when the install fails; apt's error and warning lines are shown either way.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "install-browser: installing chromium and chromium-driver with apt-get (a minute or two)"
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver; } \
    >"$log" 2>&1; then
  echo "install-browser: apt-get could not install chromium and chromium-driver; the last lines of its output:"
  tail -n 40 "$log"
  echo "install-browser: the browser test will skip"
  exit 0
fi
grep -E '^(E|W|Err): ' "$log" || true
echo "install-browser: $(/usr/bin/chromium --version 2>/dev/null || echo chromium installed)"
