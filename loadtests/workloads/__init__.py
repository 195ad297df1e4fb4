"""Deterministic workload generators and trace readers.

``create_workload(name, ["k=v", ...])`` builds any of them; see ``catalog.py``.
"""

from loadtests.workloads.base import (
    ChatMessage,
    ToolCall,
    ToolSpec,
    TracePrompt,
    Workload,
    WorkloadRequest,
)
from loadtests.workloads.catalog import create_workload, workload_names

__all__ = [
    "ChatMessage",
    "ToolCall",
    "ToolSpec",
    "TracePrompt",
    "Workload",
    "WorkloadRequest",
    "create_workload",
    "workload_names",
]
