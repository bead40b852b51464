"""Memory: what a step holds (measured, or counted from a model's structure), the planner (``finetune plan``) and
``batch_size: auto``."""
