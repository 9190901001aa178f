#!/usr/bin/env bash
# The trainers' virtualenv of the `trainers` test tier (tests/trainers): SpecForge,
# speculators and Model-Optimizer at the versions tests/trainers/requirements.txt pins, on a
# CPU build of torch, apart from the project's own .venv (their pins conflict with it).
#
#   ops/trainers-venv.sh [DIR]     (default: .trainers-venv beside this repository's .venv)
#
# Idempotent: a venv built from the same requirements and this same script is left as it is
# (a stamp inside DIR records both); otherwise DIR is built again from scratch.
# Order matters: torch first, as the CPU build this machine keeps on its disk (its exact
# local version, so that a missing wheel fails here instead of pulling a CUDA build), then
# every pinned package with --no-deps, so that none of them can replace torch.
# PYTHON chooses the interpreter (default: python3.11, else python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.trainers-venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
requirements="$root/tests/trainers/requirements.txt"
torch_spec="torch==2.13.0+cpu"

stamp_of() {
  { echo "$torch_spec"; "$python" --version; cat "$requirements" "$0"; } | sha256sum | cut -d' ' -f1
}
stamp="$(stamp_of)"
if [[ -f "$venv/.eaglegen-trainers" && "$(cat "$venv/.eaglegen-trainers")" == "$stamp" ]]; then
  echo "trainers venv up to date: $venv"
  exit 0
fi

started=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# --progress-bar off: CI logs stay readable; the wheels are cached in pip's cache dir.
"${pip[@]}" install --quiet --progress-bar off "$torch_spec"
"${pip[@]}" install --quiet --progress-bar off --no-deps -r "$requirements"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

import torch

assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__}: expected 2.13.0+cpu"
assert torch.version.cuda is None, "a CUDA build of torch was installed"
import modelopt.torch.utils.plugins.transformers_dataset  # noqa: F401
import specforge.config.schema  # noqa: F401
import specforge.data.preprocessing  # noqa: F401
import speculators.models.eagle3  # noqa: F401
import speculators.train.data  # noqa: F401

names = ("specforge", "speculators", "nvidia-modelopt", "transformers", "datasets")
print("trainers venv:", ", ".join(f"{n} {md.version(n)}" for n in names), f"torch {torch.__version__}")
EOF
echo "$stamp" >"$venv/.eaglegen-trainers"
echo "trainers venv built in $((SECONDS - started)) s: $venv"
