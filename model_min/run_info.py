"""What a JSON result records about its run: device, versions, time; shared by
``python -m model_min demo|generate --json`` and the benchmarks in ``bench/``."""

import datetime
import json
import platform
from pathlib import Path

import torch


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {
            "name": f"CPU ({platform.processor() or platform.machine()})",
            "type": "cpu",
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
        }
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "type": "cuda",
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_cache_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1) or None,
    }


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
    }


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
