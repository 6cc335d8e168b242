"""The parallel layout of one LLM replica, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size``: ranks that split every layer (attention heads, dense MLP
    columns; the MoE experts' columns unless ``enable_expert_parallel``).
    ``enable_expert_parallel``: the MoE layers place whole experts per rank instead; the
    expert-parallel size is TP x DP (vLLM's meaning). ``data_parallel_size``: attention
    replicas; only 1 is served so far (the config refuses more with a message that says so).
    ``backend``: the collectives' backend, ``auto`` = NCCL on CUDA, gloo on the CPU with a
    shared-memory segment for what fits (``shm``); ``gloo``: gloo over TCP alone."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 (data-parallel attention) is not served yet: run one replica "
                             "per data-parallel rank behind the gateway, or use tensor_parallel_size")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"distributed backend must be auto, gloo or nccl, got {self.backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are placed over (1: every rank holds every expert's share)."""
        return self.world_size if self.enable_expert_parallel else 1

    @property
    def shared_memory(self) -> bool:
        """CPU ranks exchange through shared memory (``auto``), not gloo's sockets alone."""
        return self.backend == "auto"

    def backend_for(self, device: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.startswith("cuda") else "gloo"

    @classmethod
    def of(cls, settings) -> "ParallelConfig":
        """From an ``LLMSettings`` (its ``tensor_parallel_size`` ... fields)."""
        return cls(settings.tensor_parallel_size, settings.data_parallel_size, settings.enable_expert_parallel,
                   settings.distributed_backend)
