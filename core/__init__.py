"""The shared base under every other package: what producer, worker and models agree on.

- ``settings``: the one validated settings object, and the resolved service URLs.
- ``urls``: database URL normalisation and the redaction of secrets in URLs.
- ``keys``: every Redis key name besides Celery's own.
- ``wire``: the Celery/kombu message envelope, built and parsed in one place.
- ``broker``: publishing those envelopes to Redis, and reading the queue back.
- ``sampling``: the SGLang sampling keys, their defaults and who may set them.
- ``text``: outside text with its control characters escaped, to store or show.
- ``bounded``: calls to a server with a size cap and a total deadline (probes, metrics).
- ``tokenizer``: loading a run's tokenizer and decoding its ids exactly.
- ``anatomy``, ``calls``, ``families``: a generation's reasoning, answer and tool calls, read
  from its ids by the layout of its model family.
- ``heartbeat``: the worker's heartbeat record, written and read in one place.

Nothing here imports any other eaglegen package (import-linter checks it in ``make lint``).
"""
