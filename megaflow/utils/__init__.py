"""Generic helpers with no RL or Megatron domain logic."""
