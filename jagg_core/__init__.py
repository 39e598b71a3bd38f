"""JAGG Studio core: GRPO LoRA fine-tuning of flow-matching text-to-image models."""

__version__ = "0.1.0"
