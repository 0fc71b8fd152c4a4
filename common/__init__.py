"""Leaf utilities every package may import; ``common`` itself imports nothing of the project."""
