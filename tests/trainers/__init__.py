"""The `trainers` tier: each `eaglegen export --for` layout loaded by its trainer's own code
(SpecForge, speculators, Model-Optimizer at the versions tests/trainers/requirements.txt
pins), in their own virtualenv (ops/trainers-venv.sh), compared with Postgres row for row,
and a few EAGLE-3 drafter steps with speculators' drafter on an export.

The scripts under loaders/ run inside that venv (they import the trainers, never eaglegen)
and write what the trainer produced as JSON; the tests compare it with the database.
"""
