"""The shared base under every other package: what producer, worker and models agree on.

- ``settings``: the one validated settings object, and the resolved service URLs.
- ``urls``: database URL normalisation and the redaction of secrets in URLs.
- ``keys``: every Redis key name besides Celery's own.
- ``wire``: the Celery/kombu message envelope, built and parsed in one place.
- ``broker``: publishing those envelopes to Redis, and reading the queue back.
- ``sampling``: the SGLang sampling keys, their defaults and who may set them.

Nothing here imports any other eaglegen package (import-linter checks it in ``make lint``).
"""
