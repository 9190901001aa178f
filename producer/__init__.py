"""Dataset readers, row normalisation, chat templating and enqueueing."""
