"""The fork's PPO controller and actor (subclasses of upstream's), and the weight-sync check."""
