"""On-disk state: the model store (and later the SQLite batch store)."""
