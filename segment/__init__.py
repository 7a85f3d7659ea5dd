"""Instance segmentation: only what masks add to the shared detection machinery (ops, loss, task, entry points)."""
