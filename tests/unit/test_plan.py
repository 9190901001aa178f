"""The arithmetic of `eaglegen plan` (eaglegen.report.plan), the case study's figures included."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from eaglegen.cli.plan import parse_metrics
from eaglegen.report import plan as p
from eaglegen.sim import metrics as sim_metrics
from eaglegen.sim import scheduler as sim_scheduler
from models.plan import DatasetLengths
from models.snapshot import DatasetStatus, Window

NOW = datetime(2026, 12, 1, tzinfo=UTC)
# The real run's server (/work/shared/background/case-study.txt): 159K tokens of bf16 KV.
KIMI = p.ServerFacts("kimi", kv_tokens=159_000, max_running_requests=None)


def status(
    name: str = "d",
    *,
    queued: int = 0,
    done: int = 0,
    prompt: int = 0,
    completion: int = 0,
    budget: int | None = None,
    used: int = 0,
    basis: str = "completion",
    recent: tuple[int, int] = (0, 0),  # completions and completion tokens in the last 10 min
) -> DatasetStatus:
    n, tokens = recent
    return DatasetStatus(
        run="r", dataset=name,
        states={"queued": queued, "running": 0, "done": done, "failed": 0, "skipped_budget": 0},
        done_prompt_tokens=prompt, done_completion_tokens=completion,
        budget_tokens=budget, budget_basis=basis, used_tokens=used, reserved_tokens=0,
        first_done_at=None, last_done_at=None,
        windows=(Window(60), Window(600, completions=n, completion_tokens=tokens)),
    )  # fmt: skip


def measured(
    name: str, samples: list[tuple[int, int]], max_new: int, **kwargs: int | str | None
) -> tuple[DatasetLengths, DatasetStatus]:
    """A dataset whose every done generation is in the sample."""
    lengths = DatasetLengths(name, max_new, tuple(samples), pending_prompt=None)
    done = status(
        name,
        done=len(samples),
        prompt=sum(s[0] for s in samples),
        completion=sum(s[1] for s in samples),
        **kwargs,  # type: ignore[arg-type]
    )
    return lengths, done


def case_study_samples(n: int = 5000, seed: int = 0) -> list[tuple[int, int]]:
    """Prompts near 1K tokens, outputs of 3-4K, as the case study's run had."""
    rnd = random.Random(seed)
    return [(rnd.randint(800, 1200), rnd.randint(3000, 4000)) for _ in range(n)]


# --- SGLang's admission ----------------------------------------------------------------------


def test_the_admission_constants_are_those_the_simulator_takes_from_sglang() -> None:
    assert p.INIT_NEW_TOKEN_RATIO == sim_scheduler.INIT_NEW_TOKEN_RATIO
    assert p.MIN_NEW_TOKEN_RATIO_FACTOR == sim_scheduler.MIN_NEW_TOKEN_RATIO_FACTOR
    assert p.CLIP_MAX_NEW_TOKENS == sim_scheduler.CLIP_MAX_NEW_TOKENS


@pytest.mark.parametrize(("completion", "max_new", "clip"), [
    (300, 1000, 4096), (1000, 1000, 4096), (2000, 10_000, 4096), (9000, 10_000, 4096),
    (10_000, 10_000, 4096), (50, 64, 16),
])  # fmt: skip
def test_the_charge_is_the_integral_of_the_clipped_remainder(
    completion: int, max_new: int, clip: int
) -> None:
    # Step by step, as the scheduler charges it: min(M - g, clip) at each g < C.
    stepwise = sum(min(max_new - g, clip) for g in range(completion))
    assert p.charge(completion, max_new, clip) == pytest.approx(stepwise, rel=0.002)


def test_the_mean_footprint_is_what_a_busy_batch_holds_per_request() -> None:
    # Lanes that each run requests back to back: averaged over the steps, a lane holds
    # held slots and is charged promised (Little's law, long answers weighing more).
    rnd = random.Random(7)
    samples = [(rnd.randint(10, 200), rnd.choice([5, 20, 400, 1000])) for _ in range(2000)]
    lengths, done = measured("d", samples, max_new=1000)
    shape = p.measured_shape(lengths, done, clip=256)
    assert shape is not None
    held = charged = steps = 0
    for prompt, completion in samples:
        for g in range(completion):
            held += prompt + g
            charged += min(1000 - g, 256)
            steps += 1
    assert shape.held == pytest.approx(held / steps, rel=0.002)
    assert shape.promised == pytest.approx(charged / steps, rel=0.002)
    # The plain mean request would say far more fit: the long ones are in most steps.
    mean_p = sum(s[0] for s in samples) / len(samples)
    mean_c = sum(s[1] for s in samples) / len(samples)
    assert shape.held > 1.3 * (mean_p + mean_c / 2)


def test_the_case_study_server_fits_about_fifty_of_its_requests() -> None:
    # ~1K prompts and 3-4K outputs on 159K tokens: "only about 50 could fit", not the
    # 150 the run had in flight.
    for max_new in (4096, 8192, 32_768):
        lengths, done = measured("d", case_study_samples(), max_new, queued=80_000)
        result = p.plan_run("r", [KIMI], [lengths], [done])
        fit = result.servers[0].concurrency
        assert 45 <= fit.recommended <= 55, (max_new, fit)
        assert fit.recommended == fit.at_floor and fit.limited_by == "kv"
        assert fit.at_init < fit.at_floor < fit.kv_only <= 159_000 // 2750
        assert 150 / fit.recommended > 2.5


def test_max_running_requests_caps_the_recommendation() -> None:
    lengths, done = measured("d", [(100, 200)] * 10, 256, queued=10)
    capped = p.ServerFacts("s", kv_tokens=159_000, max_running_requests=64)
    fit = p.plan_run("r", [capped], [lengths], [done]).servers[0].concurrency
    assert (fit.recommended, fit.limited_by) == (64, "max_running_requests")
    assert fit.at_floor > 64


def test_a_ratio_of_one_reserves_every_request_its_whole_max_new_tokens() -> None:
    # The simulator's fast preset: each request is then priced at its prompt + max_new.
    lengths, done = measured("d", [(100, 30), (300, 64)], 64, queued=5)
    server = p.ServerFacts("s", kv_tokens=10_000, max_running_requests=None,
                           init_ratio=1.0, floor_ratio=1.0)  # fmt: skip
    shape = p.plan_run("r", [server], [lengths], [done]).servers[0].shape
    per_step = (164 * 30 + 364 * 64) / (30 + 64)
    assert shape.footprint(1.0) == pytest.approx(per_step)
    assert p.fits(10_000, shape, 1.0) == int((10_000 - (200 + 64)) // per_step)


# --- the case study's ETAs -------------------------------------------------------------------


def test_the_case_study_57_hours_are_88088_prompts_at_26_completions_a_minute() -> None:
    # 8 datasets, 88,088 prompts left, 26 completions a minute, ~600 tok/s: "approximately
    # 57 hours". A completion of 1,385 tokens is what makes 26 a minute ~600 tok/s.
    mean = 1_385
    parts = [measured(f"ds{i}", [(1000, mean)] * 100, 16_384, queued=11_011) for i in range(8)]
    lengths, statuses = [ln for ln, _ in parts], [st for _, st in parts]
    statuses[0] = status("ds0", queued=11_011, done=100, prompt=100_000, completion=100 * mean,
                         recent=(260, 260 * mean))  # fmt: skip
    result = p.plan_run("r", [KIMI], lengths, statuses)
    assert result.throughput.source == "measured over the last 10m"
    assert result.throughput.tok_s == pytest.approx(260 * mean / 600)  # 600.2
    assert sum(f.remaining_jobs for f in result.datasets) == 88_088
    assert result.eta_s is not None and result.eta_s == pytest.approx(88_088 / (26 / 60))
    assert 56 < result.eta_s / 3600 < 57


@pytest.mark.parametrize(("tok_s", "hours"), [(930, 26.9), (1_000, 25.0), (1_350, 18.5)])
def test_nine_budgets_of_ten_million_tokens_take_about_a_day(tok_s: float, hours: float) -> None:
    # 9 datasets capped at 10M completion tokens each, far more prompts than the caps take:
    # 90M tokens at 930-1,350 tok/s is 18.5-27 hours, not the 57 of the uncapped run.
    parts = [
        measured(f"ds{i}", case_study_samples(200, seed=i), 16_384, queued=10_000,
                 budget=10_000_000)
        for i in range(9)
    ]  # fmt: skip
    lengths = [ln for ln, _ in parts]
    statuses = [st for _, st in parts]
    result = p.plan_run("r", [KIMI], lengths, statuses, tok_s=tok_s)
    left = sum(10_000_000 - st.used_tokens for st in statuses)
    assert result.remaining_tokens == pytest.approx(left)
    assert result.eta_s is not None and result.eta_s / 3600 == pytest.approx(hours, abs=0.1)
    # Side by side, every dataset finishes with the run; each needs a ninth of its time.
    for f in result.datasets:
        assert f.eta_s == result.eta_s
        assert f.alone_s == pytest.approx(f.remaining_tokens / tok_s)
    assert sum(f.alone_s or 0 for f in result.datasets) == pytest.approx(result.eta_s)
    document = p.plan_document(result, NOW)
    assert document["eta_s"] == round(result.eta_s, 1)
    assert document["recommended_concurrency"] == result.recommended


# --- datasets, budgets and priors ------------------------------------------------------------


def test_before_any_generation_a_dataset_is_its_prompts_with_answers_max_new_long() -> None:
    lengths = DatasetLengths("new", 2048, (), pending_prompt=500.0)
    fresh = status("new", queued=1_000, budget=1_000_000)
    result = p.plan_run("r", [KIMI], [lengths], [fresh], decode_tok_s_per_request=20.0)
    [f] = result.datasets
    assert f.shape is not None and f.shape.source == "prior"
    assert (f.shape.prompt, f.shape.completion) == (500.0, 2048.0)
    # 1,000 jobs of 2,048 would be 2.05M: the budget's 1M is what is left.
    assert f.remaining_tokens == 1_000_000
    assert f.remaining_jobs == pytest.approx(1_000_000 / 2048)
    fit = result.servers[0].concurrency
    assert fit.at_floor == p.fits(159_000, result.servers[0].shape, KIMI.floor_ratio)
    assert result.throughput.tok_s == fit.recommended * 20.0
    assert result.throughput.source.startswith("estimated")
    assert result.eta_s == pytest.approx(1_000_000 / (fit.recommended * 20.0))


def test_a_total_budget_leaves_the_completions_their_share() -> None:
    lengths, done = measured("d", [(300, 100)] * 10, 512, queued=1_000, budget=50_000,
                             used=4_000, basis="total")  # fmt: skip
    [f] = p.plan_run("r", [KIMI], [lengths], [done], tok_s=100.0).datasets
    assert f.budget_left == 46_000
    assert f.remaining_tokens == pytest.approx(46_000 * 100 / 400)


def test_spent_budgets_and_empty_queues_are_finished() -> None:
    a = measured("spent", [(10, 10)] * 3, 64, queued=50, budget=30, used=30)
    b = measured("empty", [(10, 10)] * 3, 64)
    c = measured("busy", [(10, 20)] * 3, 64, queued=10)
    result = p.plan_run("r", [KIMI], [x[0] for x in (a, b, c)], [x[1] for x in (a, b, c)],
                        tok_s=10.0)  # fmt: skip
    spent, empty, busy = result.datasets
    assert (spent.finished, empty.finished, busy.finished) == ("budget reached", "all jobs done",
                                                               None)  # fmt: skip
    assert spent.eta_s == empty.eta_s == 0.0 and busy.eta_s == result.eta_s == 200 / 10.0
    # Only the busy dataset's requests will be in the batch.
    assert result.servers[0].shape.completion == 20.0


def test_a_finished_run_still_says_what_fitted() -> None:
    lengths, done = measured("d", [(100, 50)] * 4, 64)
    result = p.plan_run("r", [KIMI], [lengths], [done])
    assert result.finished == "every dataset finished" and result.eta_s == 0.0
    assert result.servers[0].shape.completion == 50.0 and result.recommended > 0


def test_the_throughput_is_the_flag_then_the_measured_then_an_estimate() -> None:
    recent = status(recent=(10, 6_000))
    assert p.throughput([recent], 50, tok_s=7.0) == p.Throughput(7.0, "--tok-s")
    assert p.throughput([recent], 50, decode_tok_s_per_request=1.0).tok_s == 10.0
    quiet = status()
    estimate = p.throughput([quiet], 50, decode_tok_s_per_request=20.0)
    assert estimate.tok_s == 1000.0 and "50 in flight" in estimate.source
    assert p.throughput([quiet], 50) == p.Throughput(None, "unknown")
    lengths = DatasetLengths("d", 64, (), pending_prompt=10.0)
    unknown = p.plan_run("r", [KIMI], [lengths], [status(queued=5)])
    assert unknown.eta_s is None and unknown.datasets[0].eta_s is None


def test_no_dataset_with_a_length_is_an_error() -> None:
    with pytest.raises(ValueError, match="no dataset of the run has a job"):
        p.plan_run("r", [KIMI], [DatasetLengths("d", 64, (), None)], [status()])


# --- server facts ------------------------------------------------------------------------


def test_facts_from_sglang_scale_the_ratio_by_its_conservativeness() -> None:
    info = {"max_total_num_tokens": 159_000, "max_running_requests": None,
            "schedule_conservativeness": 0.5}  # fmt: skip
    facts = p.server_facts("s", info, {"sglang:num_running_reqs": 48.0})
    assert (facts.kv_tokens, facts.max_running_requests) == (159_000, None)
    assert facts.init_ratio == pytest.approx(0.35)
    assert facts.floor_ratio == pytest.approx(0.35 * 0.14)
    assert facts.running_now == 48 and facts.queued_now is None
    assert facts.sources == {"kv_tokens": "/get_server_info", "max_running_requests": "unknown",
                             "ratio": "sglang"}  # fmt: skip


def test_facts_from_the_simulator_take_its_own_admission_knobs() -> None:
    info = {"max_total_num_tokens": 1000, "max_running_requests": 8,
            "simulator": {"init_new_token_ratio": 1.0, "min_new_token_ratio": 1.0,
                          "clip_max_new_tokens": 512}}  # fmt: skip
    facts = p.server_facts("s", info, None, max_running_requests=4)
    assert (facts.init_ratio, facts.floor_ratio, facts.clip) == (1.0, 1.0, 512)
    assert facts.max_running_requests == 4 and facts.sources["max_running_requests"] == "flag"


def test_the_pool_comes_from_metrics_when_server_info_lacks_it() -> None:
    text = sim_metrics.render(
        sim_metrics.Snapshot(
            num_running_reqs=3, num_queue_reqs=7, num_used_tokens=10, token_usage=0.1,
            gen_throughput=1.0, cache_hit_rate=0.0, max_total_num_tokens=159_000,
            prompt_tokens_total=0, generation_tokens_total=0, cached_tokens_total=0,
            num_requests_total=0,
        ),
        sim_metrics.Histogram(),
        "m",
    )  # fmt: skip
    facts = p.server_facts("s", None, parse_metrics(text))
    assert (facts.kv_tokens, facts.running_now, facts.queued_now) == (159_000, 3, 7)
    assert facts.sources["kv_tokens"] == "/metrics"
    assert parse_metrics("not prometheus {") == {}
    with pytest.raises(ValueError, match="--kv-tokens"):
        p.server_facts("s", {"version": "x"}, {})
