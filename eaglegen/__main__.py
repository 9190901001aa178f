"""``python -m eaglegen`` and the ``eaglegen`` console script.

The CLI is imported inside ``main``, not here: multiprocessing runs the main script again in
each template worker process, and a top-level import of the CLI there would cost every
worker memory it never uses (BENCHMARKS.md, "Memory").
"""


def main() -> None:
    """Run the CLI."""
    from eaglegen.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
