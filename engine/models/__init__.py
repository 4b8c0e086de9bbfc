"""Model-family blocks: each family's layer kinds, and the registry that picks them by name."""
