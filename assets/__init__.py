"""Dagster asset definitions: thin functions over the domain packages. Each module declares ``defs``."""
