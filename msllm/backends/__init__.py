"""Device backends: what a device changes on a built model (ascend.py: parallel layouts, execution profile)."""
