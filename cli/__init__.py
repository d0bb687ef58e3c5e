"""The `localserve` command line."""
