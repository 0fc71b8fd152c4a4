"""posttrain evals."""
