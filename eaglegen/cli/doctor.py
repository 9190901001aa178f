"""`eaglegen doctor`: check an SGLang server before a run (eaglegen.doctor)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eaglegen.cli.base import JsonFlag, command, console, emit_json
from eaglegen.report.text import inline

if TYPE_CHECKING:
    from eaglegen.doctor import Probe

app = typer.Typer()
# The probe conversation: short to answer, and a reasoning template opens a block for it.
PROBE = [{"role": "user", "content": "What is 17 + 25? Answer with the number."}]


@command(app)
def doctor(
    server: Annotated[str, typer.Option(help="The server's URL, e.g. http://gpu0:30000")],
    run_file: Annotated[
        Path | None,
        typer.Argument(help="RUN.toml: check for its model, tokenizer and template"),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=16,
            help="Longest answer to the probe prompt (default 8192: a reasoning model must "
            "reach its think-end token within it); cut to what the server's context leaves",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds for each whole answer of /health, model and server info and "
            "/metrics (a server that drips its answer fails the check after it)",
        ),
    ] = 10.0,  # eaglegen.doctor.PROBE_TIMEOUT_S, not imported: the CLI starts without httpx
    json_out: JsonFlag = False,
) -> None:
    """Check that a server keeps the exact tokens a run needs; exit 1 if a check fails."""
    from eaglegen.doctor import PROBE_MAX_NEW_TOKENS, examine

    probe = _probe(run_file, max_new_tokens or PROBE_MAX_NEW_TOKENS)
    report = examine(server, probe, probe_timeout_s=timeout)
    if json_out:
        emit_json(report.as_dict())
    else:
        out = console(highlight=False)
        marks = {True: "[green]ok[/]  ", False: "[red]FAIL[/]", None: "[yellow]?[/]   "}
        for check in report.checks:
            out.print(f"{marks[check.ok]} {check.name}: {inline(check.detail)}")
        if report.facts:
            out.print(", ".join(f"{k} {inline(str(v))}" for k, v in report.facts.items()))
    raise typer.Exit(0 if report.healthy else 1)


def _probe(run_file: Path | None, max_new_tokens: int) -> Probe:
    """The probe request: templated with the run's tokenizer, or the bundled one."""
    from eaglegen.assets import TOKENIZER_DIR
    from eaglegen.doctor import Probe
    from models.records import RunModel
    from producer.plan import plan_from_run_file
    from producer.rows import Prompt
    from producer.runfile import load_run_file
    from producer.template import Templater

    if run_file is None:
        templater = Templater(TOKENIZER_DIR)
        ids = templater.encode_batch([templater.render(Prompt(PROBE))])[0]
        return Probe(ids, max_new_tokens=max_new_tokens)
    plan = plan_from_run_file(load_run_file(run_file))
    templater = Templater(
        plan.tokenizer,
        trust_remote_code=plan.trust_remote_code,
        template_kwargs=plan.chat_template_kwargs,
    )
    ids = templater.encode_batch([templater.render(Prompt(PROBE))])[0]
    return Probe(
        ids,
        model=RunModel(plan.run, plan.model or plan.tokenizer.name, str(plan.tokenizer)),
        think_end_id=templater.think_end_id() if templater.opens_reasoning(ids) else None,
        vocab_size=templater.vocab_size(),
        max_new_tokens=max_new_tokens,
    )
