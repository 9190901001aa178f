"""``python -m eaglegen`` and the ``eaglegen`` console script.

The CLI is imported inside ``main``, not here: multiprocessing runs the main script again in
each template worker process, and a top-level import of the CLI there cost every worker
~20 MB of memory it never uses.
"""


def main() -> None:
    """Run the CLI."""
    from eaglegen.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
