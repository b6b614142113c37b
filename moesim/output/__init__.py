"""Output: results folders, the run timeline (Chrome trace) and figures, all written atomically."""
