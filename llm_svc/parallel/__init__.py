"""Tensor and expert parallelism's lowest layer: the layout a service runs with
(``ParallelConfig``), this process's place in its rank group and the collectives (``comm``), and
how a dimension splits over ranks (``split``). Imports torch only; the models split their
weights with it and the engine core spawns and drives the ranks (``llm_svc.core.ranks``)."""

from .config import ParallelConfig
from .comm import RankGroup, SINGLE
from .split import even_range

__all__ = ["ParallelConfig", "RankGroup", "SINGLE", "even_range"]
