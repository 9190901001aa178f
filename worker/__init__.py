"""Celery workers that call SGLang's raw /generate and record exact token ids."""
