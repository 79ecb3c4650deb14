"""What the machine must have for a config, checked in one line before any model loads, next to where
the workers start (:func:`graft_rl.engine.handles.start_workers`): Ray where ``execution: ray``, CUDA
GPUs enough for the policies, vLLM where a policy's backend is ``vllm``, and what vLLM allows in one
process (:mod:`graft_rl.policy.vllm_backend`: one sleeping engine per process)."""

from __future__ import annotations

from graft_rl.engine.config import ConfigError, TrainConfig

__all__ = ["check_resources", "check_vllm_engines", "one_engine_per_process"]


def one_engine_per_process(names: list[str]) -> str:
    return (
        f"policies {', '.join(names)}: execution: local puts their vLLM engines in one process, and vLLM keeps its "
        f"sleep allocator and rotary cache per process (one engine's sleep unmaps memory the other uses); use "
        f"execution: ray, each policy in its own process (on a single GPU ray.num_gpus=0.5, with "
        f"vllm_kwargs.gpu_memory_utilization at most 0.4 each; their engines then take turns on the GPU)"
    )


def check_vllm_engines(cfg: TrainConfig) -> None:
    """Before anything loads, in one line: ``execution: local`` holds every policy in one process, so on
    CUDA it takes one vLLM policy at most (:mod:`graft_rl.policy.vllm_backend`: what vLLM keeps per
    process), and that one on ``cuda`` or ``cuda:0`` (vLLM binds ``cuda:local_rank``)."""
    if cfg.execution != "local":
        return
    gpu_engines = [pc for pc in cfg.policies if pc.backend == "vllm" and pc.device.startswith("cuda")]
    for pc in gpu_engines:
        index = pc.device.partition(":")[2]
        if index not in ("", "0"):
            raise ConfigError(
                f"policy {pc.name!r}: device {pc.device} with backend vllm under execution: local: vLLM puts its "
                f"engine on cuda:0 of the visible devices; run with CUDA_VISIBLE_DEVICES={index} and device cuda, "
                f"or use execution: ray"
            )
    if len(gpu_engines) > 1:
        raise ConfigError(one_engine_per_process([pc.name for pc in gpu_engines]))


def check_resources(cfg: TrainConfig) -> None:
    """Fail fast, in one line, when the machine lacks what the config needs (before any model loads)."""
    import importlib.util

    gpu_policies = [pc for pc in cfg.policies if pc.device.startswith("cuda")]
    if cfg.execution == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("execution: ray needs Ray (pip install 'graft-rl[ray]'), which is not installed")
    if not gpu_policies or (cfg.execution == "ray" and cfg.ray.address is not None):
        return  # a running Ray cluster: its GPUs are checked when the actors are placed
    import torch

    if not torch.cuda.is_available():
        names = ", ".join(pc.name for pc in gpu_policies)
        cpu = " ".join(f"policies.{i}.device=cpu" for i, pc in enumerate(cfg.policies) if pc.device.startswith("cuda"))
        raise ConfigError(
            f"policies {names} need device cuda, but this machine has no CUDA GPU "
            f"(`graft plan CONFIG` shows what the config needs, `graft preflight CONFIG` rehearses it here "
            f"at toy size; {cpu} runs it on the CPU as it is)"
        )
    check_vllm_engines(cfg)
    need = sum(pc.world_size for pc in gpu_policies) if cfg.execution == "ray" else 1
    if torch.cuda.device_count() < need:
        raise ConfigError(
            f"the policies need {need} GPUs (sum of world_size), this machine has {torch.cuda.device_count()}"
        )
    for pc in cfg.policies:
        if pc.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"policy {pc.name!r}: backend vllm needs vLLM (pip install 'graft-rl[vllm]'), which is not installed"
            )
