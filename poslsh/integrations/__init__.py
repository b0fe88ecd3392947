"""Integrations with other libraries (imported lazily: each needs its own extras)."""
