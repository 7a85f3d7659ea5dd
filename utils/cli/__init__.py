"""The entry points' bodies, one module per entry (train, val, predict, export), and the plumbing they share.

Each entry imports only its own pipeline: `python detect.py` never loads the training engine.
"""
