"""Parallelisms that split a model's layers (tensor parallel) or its sequences (context parallel)
across the ranks of one mesh dim, composed with FSDP on the others."""

from .tp import TP_STYLES, apply_tensor_parallel, apply_tp_styles, plan_assignments, resolve_tp_plan

__all__ = ["TP_STYLES", "apply_tensor_parallel", "apply_tp_styles", "plan_assignments", "resolve_tp_plan"]
