"""metatrain: meta-learned LLM fine-tuning with MixFlow-MG mixed-mode meta-gradients."""

__version__ = "0.1.0"
