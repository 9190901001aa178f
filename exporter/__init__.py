"""`eaglegen export`: done generations out of Postgres as training-ready token rows.

Pure logic, tested alone: ``rows`` (prompt + output ids, the loss mask, the cut to a
maximum length, the filters), ``split`` (the train/val split by a hash of seed and id),
``tally`` (what was read, exported and removed, per dataset), ``manifest`` (the manifest's
document and what an incremental export reads back from it). I/O: ``columns`` (rows as
Arrow batches), ``files`` (atomic writes, checksums), ``writers`` (Parquet, JSON Lines and
`save_to_disk` shards, each written under a temporary name and renamed when complete),
``export`` (one export pass, streamed from the repository).

Imports ``models`` and ``core`` only (import-linter checks it in ``make lint``).
"""
