"""Experiments: each module is one reproducible job behind a CLI subcommand."""
