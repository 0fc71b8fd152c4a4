"""posttrain sandboxes."""
