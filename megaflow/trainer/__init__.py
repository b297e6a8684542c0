"""The controller: the PPO/GRPO step as a plain program over worker groups."""
