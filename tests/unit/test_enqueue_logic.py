"""Row selection and prompt-length statistics of the producer."""

from __future__ import annotations

from producer.enqueue import batches, select_rows
from producer.rows import RawRow
from producer.stats import percentiles


def rows(n: int) -> list[RawRow]:
    return [RawRow(i, value={"i": i}) for i in range(n)]


def test_limit_without_seed_takes_the_first_rows() -> None:
    assert [r.index for r in select_rows(rows(10), 3, None)] == [0, 1, 2]
    assert len(list(select_rows(rows(10), None, None))) == 10


def test_seeded_sample_is_reproducible_ordered_and_spread() -> None:
    first = [r.index for r in select_rows(rows(10_000), 100, 7)]
    again = [r.index for r in select_rows(rows(10_000), 100, 7)]
    other = [r.index for r in select_rows(rows(10_000), 100, 8)]
    assert first == again and first != other
    assert first == sorted(first) and len(set(first)) == 100
    assert min(first) < 1_000 and max(first) > 9_000  # from the whole file, not its head


def test_sample_of_a_short_file_is_the_file() -> None:
    assert [r.index for r in select_rows(rows(5), 100, 1)] == [0, 1, 2, 3, 4]


def test_batches_cover_every_row_once() -> None:
    sizes = [len(b) for b in batches(rows(2500), 1024)]
    assert sizes == [1024, 1024, 452]


def test_percentiles_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentiles(values) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    assert percentiles([]) == {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    assert percentiles([7]) == {"p50": 7, "p90": 7, "p99": 7, "max": 7}
