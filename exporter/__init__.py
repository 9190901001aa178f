"""`eaglegen export`: done generations out of Postgres as token rows or conversations.

Pure logic, tested alone: ``rows`` (prompt + output ids, the loss mask, the cut to a
maximum length, the filters), ``conversations`` (the decoded assistant turn and the
SpecForge / Model-Optimizer row shapes, over ``core.anatomy``), ``roundtrip`` (re-templated
ids against the recorded ones, and its per-dataset tally), ``merge`` (whether a
conversation's turns extend each other, and the spans its merged row trains), ``split``
(the train/val split by a hash of seed and job or conversation), ``tally`` (what was read,
exported and removed, per dataset), ``manifest`` (the manifest's document and what an
incremental export reads back from it).

I/O: ``columns`` (rows as Arrow batches), ``folder`` (the output folder: its lock, the
export's private temporary folder, files created there without following links and moved
into place, what a killed export left), ``files`` (atomic writes, checksums),
``writers`` (Parquet, JSON Lines and `save_to_disk` shards, each written in the private
folder and moved into place when complete), ``tokenizer`` (the run's tokenizer: decode, render,
encode), ``shaping`` (a generation or a conversation decoded into its conversation line, or
judged by ``--only-valid``), ``whole`` (a conversation read whole as merged token rows),
``export`` (one export pass, streamed from the repository).

Imports ``models`` and ``core`` only (import-linter checks it in ``make lint``).
"""
