"""Example jobs; each runs as ``torchrun ... -m ddp_trainer.examples.<name>``."""
