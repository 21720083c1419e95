"""The built-in world model: procedural worlds, the model, training and generation."""
