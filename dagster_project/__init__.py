"""Dagster wiring for posttrain: the Definitions object, resources, partitions, sensors and jobs."""
