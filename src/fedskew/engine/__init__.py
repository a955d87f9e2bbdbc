"""Round engine and executors."""
