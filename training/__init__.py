"""posttrain training."""
