"""megaflow: RL post-training of LLMs on Megatron-core 3D parallelism under a single Ray controller."""

__version__ = "0.1.0"
