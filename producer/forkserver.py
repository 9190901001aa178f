"""Imported last by the template workers' fork server: freezes its heap before any fork.

A worker forked from the server shares the server's memory pages until it writes to them,
and a garbage-collection pass in the worker writes to every object it traverses: without
this, the first full collection in each worker copied everything the server had imported
(transformers, and the CLI behind a console script), ~40 MB per worker. Frozen objects are
never traversed (the `gc.freeze` documentation recommends it before forking).
"""

import gc

gc.freeze()
