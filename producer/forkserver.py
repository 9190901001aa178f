"""Imported last by the template workers' fork server: freezes its heap before any fork.

A worker forked from the server shares the server's memory pages until it writes to them,
and a garbage-collection pass in the worker writes to every object it traverses: without
this, each worker's collections copied pages of what the server had imported (transformers,
the main script's imports; BENCHMARKS.md, "Memory"). Frozen objects are never traversed
(the `gc.freeze` documentation recommends it before forking).
"""

import gc

gc.freeze()
