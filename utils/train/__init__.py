"""Training: the engine (fit), its epoch (step.py), run set-up, optimizer, EMA, loss, checkpoints, results.csv."""
