"""The enqueue command's wiring: services, templater, progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from eaglegen.queue import make_celery
from eaglegen.sampling import complete
from eaglegen.settings import Settings
from models.db import make_engine
from models.repository import Repository
from producer.enqueue import EnqueueRequest, EnqueueSummary, enqueue
from producer.template import Templater


def run_enqueue(
    settings: Settings,
    file: Path,
    *,
    run: str,
    dataset: str,
    tokenizer: Path,
    sampling: dict[str, Any],
    model: str | None = None,
) -> EnqueueSummary:
    """Enqueue one dataset file with a progress bar on stderr."""
    assert settings.database_url is not None
    templater = Templater(tokenizer)
    engine = make_engine(settings.database_url, pool_size=2)
    app = make_celery(settings)
    params = complete(sampling, templater.stop_token_ids())
    request = EnqueueRequest(
        run=run, dataset=dataset, path=file, sampling_params=params, model_name=model
    )
    try:
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"enqueue {dataset}", total=None)
            return enqueue(
                Repository(engine),
                app,
                settings.queue,
                templater,
                request,
                progress=lambda n: bar.advance(task, n),
            )
    finally:
        engine.dispose()
        app.close()
