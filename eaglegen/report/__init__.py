"""What users look at: status, stats, exports. Everything is read from Postgres."""
