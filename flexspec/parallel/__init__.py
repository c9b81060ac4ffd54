"""Past one device: context parallelism (:mod:`.context`), the query rows of a sequence sharded
over ranks, balanced by the spec's own block structure (:mod:`.balance`)."""

from flexspec.parallel.context import ContextParallel

__all__ = ["ContextParallel"]
