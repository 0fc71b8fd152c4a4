"""posttrain serving."""
