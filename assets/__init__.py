"""Package data (installed as `quantwm.assets`): the built-in world model's weights; see README.md here."""
