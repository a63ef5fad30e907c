"""Worker side: the Stage API, the worker loop, batching under a deadline, the supervisor."""

from workers.stage import Stage

__all__ = ["Stage"]
