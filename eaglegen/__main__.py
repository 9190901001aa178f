"""``python -m eaglegen`` runs the CLI."""

from eaglegen.cli import main

main()
