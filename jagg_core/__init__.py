"""JAGG Studio core: GRPO LoRA fine-tuning of flow-matching image, image-editing and video models."""

__version__ = "0.1.0"
