"""Postgres models and the repository: the only package that contains SQL."""
